-- The review desk follows a run by asking what changed since its last look: the tasks whose
-- state moved and the outputs downloaded after a moment, by run, from an index each, so a
-- poll costs what changed, not the run.
CREATE INDEX tasks_by_run_update ON tasks(run_id, updated_at);
CREATE INDEX outputs_by_run_download ON outputs(run_id, downloaded_at);
