-- The PostgreSQL twin of migrations/sqlite/20261130000700_reroll_undo.sql.
-- What a reroll found before it reset anything, written in the transaction that resets its
-- tasks: the run's status, and a copy of each task row it resets and of each output row it sets
-- aside. A reroll that could not be done (its calls refused before billing: a 400, the
-- balance, a cap) is undone from them, in one transaction: the rows as they were, the outputs
-- current again, their files moved back from `_superseded/`. Forgotten with the reroll then;
-- kept with a reroll that paid for something (it is the record of what it replaced).
ALTER TABLE rerolls ADD COLUMN status_before TEXT;
ALTER TABLE rerolls ADD COLUMN stop_reason_before TEXT;
ALTER TABLE rerolls ADD COLUMN finished_at_before BIGINT;

CREATE TABLE reroll_tasks_before (
    reroll_id        BIGINT NOT NULL REFERENCES rerolls(id),
    task_id          BIGINT NOT NULL REFERENCES tasks(id),
    operation        TEXT NOT NULL,
    inputs           TEXT NOT NULL,
    planned_credits  BIGINT NOT NULL,
    status           TEXT NOT NULL,
    credits_billed   BIGINT NOT NULL,
    job_id           TEXT,
    error            TEXT,
    identity         TEXT,
    removed_at       BIGINT,
    reused_from      BIGINT,
    request          TEXT,
    updated_at       BIGINT NOT NULL
);

CREATE INDEX reroll_tasks_before_by_reroll ON reroll_tasks_before(reroll_id);

CREATE TABLE reroll_outputs_before (
    reroll_id       BIGINT NOT NULL REFERENCES rerolls(id),
    id              BIGINT NOT NULL,
    task_id         BIGINT NOT NULL REFERENCES tasks(id),
    run_id          TEXT NOT NULL,
    k               BIGINT NOT NULL,
    job_id          TEXT NOT NULL,
    parent_job_id   TEXT,
    url             TEXT NOT NULL,
    url_issued_at   BIGINT NOT NULL,
    path            TEXT,
    sha256          TEXT,
    bytes           BIGINT,
    downloaded_at   BIGINT,
    download_error  TEXT,
    etag            TEXT
);

CREATE INDEX reroll_outputs_before_by_reroll ON reroll_outputs_before(reroll_id);
