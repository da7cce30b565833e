-- Indexes that keep the review, `status` and `report` fast on tables PostgreSQL has not analysed
-- yet (right after a run inserted them and was killed, when a takeover arrives), and on a
-- database holding many nights' runs. PostgreSQL only: SQLite's indexes carry the row id
-- already. Append-only, like every migration.

-- A task's latest attempt (`MAX(id) ... WHERE task_id = ?`) is the last entry of its range of
-- this index. With only `attempts(task_id)` and no statistics, the planner read the primary key
-- backwards and filtered on task_id instead: every attempt for each task without one, 70 s for
-- the review of 27,648 tasks. It replaces attempts_by_task, of which it is a superset.
CREATE INDEX attempts_by_task_id ON attempts(task_id, id);
DROP INDEX attempts_by_task;

-- The run's attempts (totals, calls at risk, orphans settled at a resume, the spending chart)
-- without reading every night's attempts. Neither column is ever updated, so settling an attempt
-- stays a HOT update.
CREATE INDEX attempts_by_run ON attempts(run_id);

-- The run's live tasks in id order, as the review and the scheduler read them: no sort of the
-- whole run, however many tasks it recorded.
CREATE INDEX tasks_in_order ON tasks(run_id, id) WHERE removed_at IS NULL;
