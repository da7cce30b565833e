-- Rerolls the checks asked for (issue 46), and verdicts keyed by the job that made each
-- output. Append-only, like every migration.
--
-- check_verdicts is made again with the job: SQLite gives a new output the row id of the
-- last one deleted, so after a reroll set an output aside its successor could carry the same
-- id, and a verdict keyed by the id alone would pass for the new output's. Nothing wrote the
-- table before this migration (the executor did not run checks yet), so no verdict is lost.

DROP TABLE check_verdicts;

CREATE TABLE check_verdicts (
    run_id      TEXT NOT NULL,
    output_id   BIGINT NOT NULL,
    -- The job that made the output: with its id, what names one output for good.
    job_id      TEXT NOT NULL,
    task_id     BIGINT NOT NULL,
    -- The check's place in the step's `checks:` list (two command checks are two places).
    position    BIGINT NOT NULL,
    checks_key  TEXT NOT NULL,
    check_name  TEXT NOT NULL,
    -- passed, failed or not_checked.
    verdict     TEXT NOT NULL,
    score       REAL,
    reason      TEXT NOT NULL,
    -- rerolled, flagged or failed once acted on; NULL for a pass.
    acted       TEXT,
    checked_at  BIGINT NOT NULL,
    PRIMARY KEY (output_id, job_id, position)
);

CREATE INDEX check_verdicts_by_run ON check_verdicts (run_id, task_id);
CREATE INDEX check_verdicts_by_checks ON check_verdicts (checks_key);

-- One row each time a task was paid for again because a check failed its outputs, written
-- in the transaction that set them aside. A resume counts them against the step's
-- `max_rerolls` and the pipeline's `rerolls.max_credits`, so it never pays past either.
CREATE TABLE check_rerolls (
    run_id      TEXT NOT NULL,
    task_id     BIGINT NOT NULL,
    -- The job whose outputs failed and were set aside.
    job_id      TEXT NOT NULL,
    -- What paying for the task again was planned at.
    credits     BIGINT NOT NULL,
    rerolled_at BIGINT NOT NULL
);

CREATE INDEX check_rerolls_by_run ON check_rerolls (run_id, task_id);
