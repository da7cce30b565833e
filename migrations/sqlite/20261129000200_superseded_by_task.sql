-- The report asks for the earlier outputs (set aside by a reroll, a changed pipeline or a file
-- found modified) of one page's tasks at a time, by task.
CREATE INDEX superseded_by_task ON superseded_outputs(task_id);
