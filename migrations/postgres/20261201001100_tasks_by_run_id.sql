-- A takeover reads a run's task rows outside its blocks (`task_blocks`) by ranges of id: the
-- batch's before the first block, a chunk recorded in part after the last. Through the primary
-- key alone, the range after the last block ran to the end of the table, through every task
-- of every run recorded since (a night resumed a week later on a shared database: millions);
-- through this index, only the run's own.
-- Append-only, like every migration.

CREATE INDEX tasks_by_run_id ON tasks(run_id, id);
