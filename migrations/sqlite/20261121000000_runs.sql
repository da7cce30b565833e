-- The record of runs: what was planned, every task, every HTTP attempt and what it may have
-- billed, and every output. Append-only: never edit a migration once released.

CREATE TABLE runs (
    id               TEXT PRIMARY KEY NOT NULL,
    pipeline_name    TEXT NOT NULL,
    pipeline_file    TEXT NOT NULL,
    -- The pipeline file's full text, so a run can be understood without the file.
    pipeline_text    TEXT NOT NULL,
    pipeline_sha256  TEXT NOT NULL,
    items_sha256     TEXT NOT NULL,
    -- The plan document (JSON) the run was started with.
    plan_json        TEXT NOT NULL,
    output_dir       TEXT NOT NULL,
    status           TEXT NOT NULL CHECK (status IN
                        ('running', 'succeeded', 'failed', 'interrupted', 'stopped')),
    credits_planned  INTEGER NOT NULL,
    balance_before   INTEGER,
    balance_after    INTEGER,
    -- Why the run stopped, when it did not simply finish.
    stop_reason      TEXT,
    created_at       INTEGER NOT NULL,   -- unix milliseconds
    finished_at      INTEGER
);

CREATE TABLE tasks (
    id               INTEGER PRIMARY KEY,
    run_id           TEXT NOT NULL REFERENCES runs(id),
    -- The item's id, or '_batch' for a step that runs once for the whole batch.
    item             TEXT NOT NULL,
    step             TEXT NOT NULL,
    idx              INTEGER NOT NULL,
    operation        TEXT NOT NULL,
    -- The inputs as references to other tasks' outputs or as URLs the pipeline wrote.
    inputs           TEXT NOT NULL,
    planned_credits  INTEGER NOT NULL,
    status           TEXT NOT NULL CHECK (status IN
                        ('pending', 'running', 'succeeded', 'failed', 'blocked')),
    credits_billed   INTEGER NOT NULL DEFAULT 0,
    job_id           TEXT,
    error            TEXT,
    updated_at       INTEGER NOT NULL,
    UNIQUE (run_id, item, step, idx)
);

CREATE TABLE attempts (
    id                INTEGER PRIMARY KEY,
    task_id           INTEGER NOT NULL REFERENCES tasks(id),
    run_id            TEXT NOT NULL REFERENCES runs(id),
    endpoint          TEXT NOT NULL,
    started_at        INTEGER NOT NULL,
    finished_at       INTEGER,
    -- NULL while the call is in flight: a crash leaves exactly these rows as "maybe billed".
    outcome           TEXT CHECK (outcome IN
                        ('succeeded', 'answered_error', 'not_sent', 'ambiguous')),
    http_status       INTEGER,
    credits_billed    INTEGER NOT NULL DEFAULT 0,
    credits_remaining INTEGER,
    job_id            TEXT,
    error             TEXT
);

CREATE TABLE outputs (
    id              INTEGER PRIMARY KEY,
    task_id         INTEGER NOT NULL REFERENCES tasks(id),
    run_id          TEXT NOT NULL REFERENCES runs(id),
    k               INTEGER NOT NULL,
    job_id          TEXT NOT NULL,
    parent_job_id   TEXT,
    url             TEXT NOT NULL,
    url_issued_at   INTEGER NOT NULL,
    path            TEXT,
    sha256          TEXT,
    bytes           INTEGER,
    downloaded_at   INTEGER,
    download_error  TEXT,
    UNIQUE (task_id, k)
);

CREATE INDEX tasks_by_run ON tasks(run_id, status);
CREATE INDEX attempts_by_task ON attempts(task_id);
CREATE INDEX outputs_by_run ON outputs(run_id);
