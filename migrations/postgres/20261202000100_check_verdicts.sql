-- Checks of stored outputs (issue 46): each check's verdict on each output, with its score
-- and reason, and what was done about it. A verdict is written once: a resume reads it and
-- never checks the output again, and `acted` says whether the failure was already paid
-- for again (rerolled), kept and marked (flagged) or failed its task, so a resume never acts
-- on it twice. `checks_key` names the pipeline's step and its checks as written, so that a
-- plan can read the pass rates of the same checks in earlier runs.
-- Append-only, like every migration.

CREATE TABLE check_verdicts (
    run_id      TEXT NOT NULL,
    output_id   BIGINT NOT NULL,
    task_id     BIGINT NOT NULL,
    -- The check's place in the step's `checks:` list (two command checks are two places).
    position    BIGINT NOT NULL,
    checks_key  TEXT NOT NULL,
    check_name  TEXT NOT NULL,
    -- passed, failed or not_checked.
    verdict     TEXT NOT NULL,
    score       DOUBLE PRECISION,
    reason      TEXT NOT NULL,
    -- rerolled, flagged or failed once acted on; NULL before, and for a pass.
    acted       TEXT,
    checked_at  BIGINT NOT NULL,
    PRIMARY KEY (output_id, position)
);

CREATE INDEX check_verdicts_by_run ON check_verdicts (run_id, task_id);
CREATE INDEX check_verdicts_by_checks ON check_verdicts (checks_key);
