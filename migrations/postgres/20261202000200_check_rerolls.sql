-- Rerolls the checks asked for (issue 46): one row each time a task was paid for again
-- because a check failed its outputs, written in the transaction that set them aside. A
-- resume counts them against the step's `max_rerolls` and the pipeline's
-- `rerolls.max_credits`, so it never pays past either; status and metrics sum them.
-- Append-only, like every migration.

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
