-- The outputs a check flagged (issue 46), found without reading the run's other verdicts:
-- `status` lists the first few, and the desk's "failed a check" filter starts from them.
-- Append-only, like every migration.

CREATE INDEX check_verdicts_by_acted ON check_verdicts (run_id, acted, task_id);
