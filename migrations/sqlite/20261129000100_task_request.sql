-- Each task's request as it is sent, without its image URLs (those are the task's inputs): a
-- compact JSON object of the body's other fields, e.g. {"n":1,"prompt":"…","size":"2K"} or
-- {"object_name":"logo"}. The report shows it beside the task's images. NULL for tasks
-- recorded before this column, and for a task whose request could not be rendered.
ALTER TABLE tasks ADD COLUMN request TEXT;
