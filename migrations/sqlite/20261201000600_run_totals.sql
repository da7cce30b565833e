-- A run's totals kept as its rows are written, so that what a run has spent and how far each
-- step is are read from a row or two, never summed over every task, attempt and output of a
-- night (900,000 rows: seconds before a takeover's first paid call, and in `status`).
--
-- Kept by triggers, in the statement that writes the rows they sum: every writer (the
-- executor, a resume, a reroll and its undoing, a changed pipeline, the desk, a test's or a
-- bench's own INSERT) keeps them true without knowing of them, and a crash cannot leave them
-- apart from their rows (they commit or roll back together). Each trigger takes the row's old
-- contribution away and adds its new one, so the totals are always the sums they replace:
--
-- run_step_totals: the run's live tasks (`removed_at IS NULL`) of one step, as
--   `Runs::step_counts` counted them, in two parts summed when read: part 0 what the tasks
--   were recorded with, part 1 what changed since. Recording a chunk of items (a transaction
--   of its own, beside the hot path's writer on PostgreSQL) then never waits for, nor holds,
--   the rows the writer's status changes update, so neither stalls the other nor deadlocks
--   with it. `first_id`: the smallest task id the step ever had (the steps are listed in that
--   order).
-- run_totals: the run's attempts (credits billed; those without a complete answer, and their
--   tasks' planned credits: what they may have cost) and outputs (all, downloaded, failed).
-- Append-only, like every migration.

CREATE TABLE run_step_totals (
    run_id           TEXT NOT NULL,
    step             TEXT NOT NULL,
    -- 0: as recorded (the inserts); 1: changed since (updates and deletes).
    part             INTEGER NOT NULL,
    first_id         INTEGER NOT NULL,
    tasks            INTEGER NOT NULL DEFAULT 0,
    succeeded        INTEGER NOT NULL DEFAULT 0,
    failed           INTEGER NOT NULL DEFAULT 0,
    blocked          INTEGER NOT NULL DEFAULT 0,
    -- Pending or running.
    pending          INTEGER NOT NULL DEFAULT 0,
    planned_credits  INTEGER NOT NULL DEFAULT 0,
    billed_credits   INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (run_id, step, part)
);

CREATE TABLE run_totals (
    run_id                   TEXT PRIMARY KEY NOT NULL,
    billed_credits           INTEGER NOT NULL DEFAULT 0,
    ambiguous_attempts       INTEGER NOT NULL DEFAULT 0,
    possibly_billed_credits  INTEGER NOT NULL DEFAULT 0,
    outputs                  INTEGER NOT NULL DEFAULT 0,
    downloaded               INTEGER NOT NULL DEFAULT 0,
    download_failures        INTEGER NOT NULL DEFAULT 0
);

-- The totals of what is recorded now.
INSERT INTO run_step_totals (run_id, step, part, first_id, tasks, succeeded, failed, blocked,
                             pending, planned_credits, billed_credits)
SELECT run_id, step, 0, MIN(id),
       SUM(removed_at IS NULL),
       SUM(removed_at IS NULL AND status = 'succeeded'),
       SUM(removed_at IS NULL AND status = 'failed'),
       SUM(removed_at IS NULL AND status = 'blocked'),
       SUM(removed_at IS NULL AND status IN ('pending', 'running')),
       SUM(CASE WHEN removed_at IS NULL THEN planned_credits ELSE 0 END),
       SUM(CASE WHEN removed_at IS NULL THEN credits_billed ELSE 0 END)
FROM tasks GROUP BY run_id, step;

INSERT INTO run_totals (run_id) SELECT id FROM runs;

UPDATE run_totals SET
    billed_credits = (SELECT COALESCE(SUM(a.credits_billed), 0) FROM attempts a
                      WHERE a.run_id = run_totals.run_id),
    ambiguous_attempts = (SELECT COUNT(*) FROM attempts a WHERE a.run_id = run_totals.run_id
                          AND (a.outcome IS NULL OR a.outcome = 'ambiguous')),
    possibly_billed_credits = (SELECT COALESCE(SUM(t.planned_credits), 0)
                               FROM attempts a JOIN tasks t ON t.id = a.task_id
                               WHERE a.run_id = run_totals.run_id
                               AND (a.outcome IS NULL OR a.outcome = 'ambiguous')),
    outputs = (SELECT COUNT(*) FROM outputs o WHERE o.run_id = run_totals.run_id),
    downloaded = (SELECT COUNT(*) FROM outputs o WHERE o.run_id = run_totals.run_id
                  AND o.path IS NOT NULL),
    download_failures = (SELECT COUNT(*) FROM outputs o WHERE o.run_id = run_totals.run_id
                         AND o.path IS NULL AND o.download_error IS NOT NULL);

-- Tasks: a row counts in its step's totals while it is live.
CREATE TRIGGER tasks_totals_insert AFTER INSERT ON tasks
BEGIN
    INSERT INTO run_step_totals (run_id, step, part, first_id, tasks, succeeded, failed, blocked,
                                 pending, planned_credits, billed_credits)
    VALUES (new.run_id, new.step, 0, new.id,
            (new.removed_at IS NULL),
            (new.removed_at IS NULL AND new.status = 'succeeded'),
            (new.removed_at IS NULL AND new.status = 'failed'),
            (new.removed_at IS NULL AND new.status = 'blocked'),
            (new.removed_at IS NULL AND new.status IN ('pending', 'running')),
            CASE WHEN new.removed_at IS NULL THEN new.planned_credits ELSE 0 END,
            CASE WHEN new.removed_at IS NULL THEN new.credits_billed ELSE 0 END)
    ON CONFLICT (run_id, step, part) DO UPDATE SET
        first_id = MIN(first_id, excluded.first_id),
        tasks = tasks + excluded.tasks,
        succeeded = succeeded + excluded.succeeded,
        failed = failed + excluded.failed,
        blocked = blocked + excluded.blocked,
        pending = pending + excluded.pending,
        planned_credits = planned_credits + excluded.planned_credits,
        billed_credits = billed_credits + excluded.billed_credits;
END;

CREATE TRIGGER tasks_totals_update AFTER UPDATE OF run_id, step, status, removed_at,
        planned_credits, credits_billed ON tasks
WHEN old.run_id IS NOT new.run_id OR old.step IS NOT new.step OR old.status IS NOT new.status
    OR old.removed_at IS NOT new.removed_at OR old.planned_credits IS NOT new.planned_credits
    OR old.credits_billed IS NOT new.credits_billed
BEGIN
    INSERT INTO run_step_totals (run_id, step, part, first_id, tasks, succeeded, failed, blocked,
                                 pending, planned_credits, billed_credits)
    VALUES (old.run_id, old.step, 1, old.id,
            -(old.removed_at IS NULL),
            -(old.removed_at IS NULL AND old.status = 'succeeded'),
            -(old.removed_at IS NULL AND old.status = 'failed'),
            -(old.removed_at IS NULL AND old.status = 'blocked'),
            -(old.removed_at IS NULL AND old.status IN ('pending', 'running')),
            -CASE WHEN old.removed_at IS NULL THEN old.planned_credits ELSE 0 END,
            -CASE WHEN old.removed_at IS NULL THEN old.credits_billed ELSE 0 END)
    ON CONFLICT (run_id, step, part) DO UPDATE SET
        first_id = MIN(first_id, excluded.first_id),
        tasks = tasks + excluded.tasks,
        succeeded = succeeded + excluded.succeeded,
        failed = failed + excluded.failed,
        blocked = blocked + excluded.blocked,
        pending = pending + excluded.pending,
        planned_credits = planned_credits + excluded.planned_credits,
        billed_credits = billed_credits + excluded.billed_credits;
    INSERT INTO run_step_totals (run_id, step, part, first_id, tasks, succeeded, failed, blocked,
                                 pending, planned_credits, billed_credits)
    VALUES (new.run_id, new.step, 1, new.id,
            (new.removed_at IS NULL),
            (new.removed_at IS NULL AND new.status = 'succeeded'),
            (new.removed_at IS NULL AND new.status = 'failed'),
            (new.removed_at IS NULL AND new.status = 'blocked'),
            (new.removed_at IS NULL AND new.status IN ('pending', 'running')),
            CASE WHEN new.removed_at IS NULL THEN new.planned_credits ELSE 0 END,
            CASE WHEN new.removed_at IS NULL THEN new.credits_billed ELSE 0 END)
    ON CONFLICT (run_id, step, part) DO UPDATE SET
        first_id = MIN(first_id, excluded.first_id),
        tasks = tasks + excluded.tasks,
        succeeded = succeeded + excluded.succeeded,
        failed = failed + excluded.failed,
        blocked = blocked + excluded.blocked,
        pending = pending + excluded.pending,
        planned_credits = planned_credits + excluded.planned_credits,
        billed_credits = billed_credits + excluded.billed_credits;
END;

-- A task's planned credits are what its unanswered attempts may have cost.
CREATE TRIGGER tasks_totals_reprice AFTER UPDATE OF planned_credits ON tasks
WHEN old.planned_credits IS NOT new.planned_credits
BEGIN
    UPDATE run_totals SET possibly_billed_credits = possibly_billed_credits
        + (SELECT COALESCE(SUM(new.planned_credits - old.planned_credits), 0) FROM attempts a
           WHERE a.task_id = new.id AND a.run_id = run_totals.run_id
           AND (a.outcome IS NULL OR a.outcome = 'ambiguous'))
    WHERE run_id IN (SELECT a.run_id FROM attempts a WHERE a.task_id = new.id);
END;

CREATE TRIGGER tasks_totals_delete AFTER DELETE ON tasks
BEGIN
    INSERT INTO run_step_totals (run_id, step, part, first_id, tasks, succeeded, failed, blocked,
                                 pending, planned_credits, billed_credits)
    VALUES (old.run_id, old.step, 1, old.id,
            -(old.removed_at IS NULL),
            -(old.removed_at IS NULL AND old.status = 'succeeded'),
            -(old.removed_at IS NULL AND old.status = 'failed'),
            -(old.removed_at IS NULL AND old.status = 'blocked'),
            -(old.removed_at IS NULL AND old.status IN ('pending', 'running')),
            -CASE WHEN old.removed_at IS NULL THEN old.planned_credits ELSE 0 END,
            -CASE WHEN old.removed_at IS NULL THEN old.credits_billed ELSE 0 END)
    ON CONFLICT (run_id, step, part) DO UPDATE SET
        first_id = MIN(first_id, excluded.first_id),
        tasks = tasks + excluded.tasks,
        succeeded = succeeded + excluded.succeeded,
        failed = failed + excluded.failed,
        blocked = blocked + excluded.blocked,
        pending = pending + excluded.pending,
        planned_credits = planned_credits + excluded.planned_credits,
        billed_credits = billed_credits + excluded.billed_credits;
END;

-- Attempts: credits billed, and those that may have been billed without an answer.
CREATE TRIGGER attempts_totals_insert AFTER INSERT ON attempts
BEGIN
    INSERT INTO run_totals (run_id, billed_credits, ambiguous_attempts, possibly_billed_credits)
    VALUES (new.run_id, new.credits_billed,
            new.outcome IS NULL OR new.outcome = 'ambiguous',
            CASE WHEN new.outcome IS NULL OR new.outcome = 'ambiguous'
                 THEN COALESCE((SELECT planned_credits FROM tasks WHERE id = new.task_id), 0)
                 ELSE 0 END)
    ON CONFLICT (run_id) DO UPDATE SET
        billed_credits = billed_credits + excluded.billed_credits,
        ambiguous_attempts = ambiguous_attempts + excluded.ambiguous_attempts,
        possibly_billed_credits = possibly_billed_credits + excluded.possibly_billed_credits;
END;

CREATE TRIGGER attempts_totals_update AFTER UPDATE OF run_id, task_id, outcome, credits_billed
        ON attempts
WHEN old.run_id IS NOT new.run_id OR old.task_id IS NOT new.task_id
    OR old.outcome IS NOT new.outcome OR old.credits_billed IS NOT new.credits_billed
BEGIN
    UPDATE run_totals SET
        billed_credits = billed_credits - old.credits_billed,
        ambiguous_attempts = ambiguous_attempts
            - (old.outcome IS NULL OR old.outcome = 'ambiguous'),
        possibly_billed_credits = possibly_billed_credits
            - CASE WHEN old.outcome IS NULL OR old.outcome = 'ambiguous'
                   THEN COALESCE((SELECT planned_credits FROM tasks WHERE id = old.task_id), 0)
                   ELSE 0 END
    WHERE run_id = old.run_id;
    INSERT INTO run_totals (run_id, billed_credits, ambiguous_attempts, possibly_billed_credits)
    VALUES (new.run_id, new.credits_billed,
            new.outcome IS NULL OR new.outcome = 'ambiguous',
            CASE WHEN new.outcome IS NULL OR new.outcome = 'ambiguous'
                 THEN COALESCE((SELECT planned_credits FROM tasks WHERE id = new.task_id), 0)
                 ELSE 0 END)
    ON CONFLICT (run_id) DO UPDATE SET
        billed_credits = billed_credits + excluded.billed_credits,
        ambiguous_attempts = ambiguous_attempts + excluded.ambiguous_attempts,
        possibly_billed_credits = possibly_billed_credits + excluded.possibly_billed_credits;
END;

CREATE TRIGGER attempts_totals_delete AFTER DELETE ON attempts
BEGIN
    UPDATE run_totals SET
        billed_credits = billed_credits - old.credits_billed,
        ambiguous_attempts = ambiguous_attempts
            - (old.outcome IS NULL OR old.outcome = 'ambiguous'),
        possibly_billed_credits = possibly_billed_credits
            - CASE WHEN old.outcome IS NULL OR old.outcome = 'ambiguous'
                   THEN COALESCE((SELECT planned_credits FROM tasks WHERE id = old.task_id), 0)
                   ELSE 0 END
    WHERE run_id = old.run_id;
END;

-- Outputs: all, those with a file or object, those whose download failed.
CREATE TRIGGER outputs_totals_insert AFTER INSERT ON outputs
BEGIN
    INSERT INTO run_totals (run_id, outputs, downloaded, download_failures)
    VALUES (new.run_id, 1, new.path IS NOT NULL,
            new.path IS NULL AND new.download_error IS NOT NULL)
    ON CONFLICT (run_id) DO UPDATE SET
        outputs = outputs + 1,
        downloaded = downloaded + excluded.downloaded,
        download_failures = download_failures + excluded.download_failures;
END;

CREATE TRIGGER outputs_totals_update AFTER UPDATE OF run_id, path, download_error ON outputs
WHEN old.run_id IS NOT new.run_id OR (old.path IS NULL) IS NOT (new.path IS NULL)
    OR (old.download_error IS NULL) IS NOT (new.download_error IS NULL)
BEGIN
    UPDATE run_totals SET
        outputs = outputs - 1,
        downloaded = downloaded - (old.path IS NOT NULL),
        download_failures = download_failures
            - (old.path IS NULL AND old.download_error IS NOT NULL)
    WHERE run_id = old.run_id;
    INSERT INTO run_totals (run_id, outputs, downloaded, download_failures)
    VALUES (new.run_id, 1, new.path IS NOT NULL,
            new.path IS NULL AND new.download_error IS NOT NULL)
    ON CONFLICT (run_id) DO UPDATE SET
        outputs = outputs + 1,
        downloaded = downloaded + excluded.downloaded,
        download_failures = download_failures + excluded.download_failures;
END;

CREATE TRIGGER outputs_totals_delete AFTER DELETE ON outputs
BEGIN
    UPDATE run_totals SET
        outputs = outputs - 1,
        downloaded = downloaded - (old.path IS NOT NULL),
        download_failures = download_failures
            - (old.path IS NULL AND old.download_error IS NOT NULL)
    WHERE run_id = old.run_id;
END;

-- `status` lists the attempts that may have been billed, and the failed downloads: few rows,
-- found without reading every attempt and output of the run.
CREATE INDEX attempts_unanswered ON attempts(run_id, id)
    WHERE outcome IS NULL OR outcome = 'ambiguous';
CREATE INDEX outputs_failed ON outputs(run_id, task_id, k)
    WHERE path IS NULL AND download_error IS NOT NULL;
