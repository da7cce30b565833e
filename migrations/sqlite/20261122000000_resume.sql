-- Resume, changed pipelines and reuse across runs. Append-only, like every migration.

-- sha256 of the request and of its input images' bytes (not their URLs, which change on every
-- refresh): the same identity means the same work. Set once every input's bytes are known.
ALTER TABLE tasks ADD COLUMN identity TEXT;
-- When `--allow-changes` dropped the task from the pipeline: kept for the record of what it
-- cost, left out of everything else.
ALTER TABLE tasks ADD COLUMN removed_at INTEGER;
-- The earlier task whose outputs this one took instead of paying again (`--reuse`).
ALTER TABLE tasks ADD COLUMN reused_from INTEGER REFERENCES tasks(id);

CREATE INDEX tasks_by_identity ON tasks(identity) WHERE identity IS NOT NULL;

-- Outputs a task no longer has: those of a job that fell short before the task ran again, of a
-- task changed by `--allow-changes`, or a file found modified on disk. The file was moved, not
-- deleted, to `path`.
CREATE TABLE superseded_outputs (
    id              INTEGER PRIMARY KEY,
    task_id         INTEGER NOT NULL REFERENCES tasks(id),
    run_id          TEXT NOT NULL REFERENCES runs(id),
    k               INTEGER NOT NULL,
    job_id          TEXT NOT NULL,
    path            TEXT,
    sha256          TEXT,
    bytes           INTEGER,
    reason          TEXT NOT NULL,
    superseded_at   INTEGER NOT NULL
);

CREATE INDEX superseded_by_run ON superseded_outputs(run_id);
