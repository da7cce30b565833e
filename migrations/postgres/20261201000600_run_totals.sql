-- A run's totals kept as its rows are written, so that what a run has spent and how far each
-- step is are read from a row or two, never summed over every task, attempt and output of a
-- night (900,000 rows: seconds before a takeover's first paid call, and in `status`).
--
-- The PostgreSQL twin of migrations/sqlite/20261201000600_run_totals.sql, its triggers taken
-- per statement (each statement's rows summed once, through its transition tables).
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
--   of its own, beside the hot path's writer) then never waits for, nor holds, the rows the
--   writer's status changes update, so neither stalls the other nor deadlocks with it.
--   `first_id`: the smallest task id the step ever had (the steps are listed in that order).
-- run_totals: the run's attempts (credits billed; those without a complete answer, and their
--   tasks' planned credits: what they may have cost) and outputs (all, downloaded, failed).
-- Append-only, like every migration.

CREATE TABLE run_step_totals (
    run_id           TEXT NOT NULL,
    step             TEXT NOT NULL,
    -- 0: as recorded (the inserts); 1: changed since (updates and deletes).
    part             SMALLINT NOT NULL,
    first_id         BIGINT NOT NULL,
    tasks            BIGINT NOT NULL DEFAULT 0,
    succeeded        BIGINT NOT NULL DEFAULT 0,
    failed           BIGINT NOT NULL DEFAULT 0,
    blocked          BIGINT NOT NULL DEFAULT 0,
    -- Pending or running.
    pending          BIGINT NOT NULL DEFAULT 0,
    planned_credits  BIGINT NOT NULL DEFAULT 0,
    billed_credits   BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (run_id, step, part)
);

CREATE TABLE run_totals (
    run_id                   TEXT PRIMARY KEY NOT NULL,
    billed_credits           BIGINT NOT NULL DEFAULT 0,
    ambiguous_attempts       BIGINT NOT NULL DEFAULT 0,
    possibly_billed_credits  BIGINT NOT NULL DEFAULT 0,
    outputs                  BIGINT NOT NULL DEFAULT 0,
    downloaded               BIGINT NOT NULL DEFAULT 0,
    download_failures        BIGINT NOT NULL DEFAULT 0
);

-- The totals of what is recorded now.
INSERT INTO run_step_totals (run_id, step, part, first_id, tasks, succeeded, failed, blocked,
                             pending, planned_credits, billed_credits)
SELECT run_id, step, 0, MIN(id),
       COUNT(*) FILTER (WHERE removed_at IS NULL),
       COUNT(*) FILTER (WHERE removed_at IS NULL AND status = 'succeeded'),
       COUNT(*) FILTER (WHERE removed_at IS NULL AND status = 'failed'),
       COUNT(*) FILTER (WHERE removed_at IS NULL AND status = 'blocked'),
       COUNT(*) FILTER (WHERE removed_at IS NULL AND status IN ('pending', 'running')),
       COALESCE(SUM(planned_credits) FILTER (WHERE removed_at IS NULL), 0),
       COALESCE(SUM(credits_billed) FILTER (WHERE removed_at IS NULL), 0)
FROM tasks GROUP BY run_id, step;

INSERT INTO run_totals (run_id) SELECT id FROM runs;

UPDATE run_totals r SET
    billed_credits = a.billed, ambiguous_attempts = a.ambiguous, possibly_billed_credits = a.possibly
FROM (SELECT a.run_id, COALESCE(SUM(a.credits_billed), 0) AS billed,
             COUNT(*) FILTER (WHERE a.outcome IS NULL OR a.outcome = 'ambiguous') AS ambiguous,
             COALESCE(SUM(t.planned_credits)
                 FILTER (WHERE a.outcome IS NULL OR a.outcome = 'ambiguous'), 0) AS possibly
      FROM attempts a JOIN tasks t ON t.id = a.task_id GROUP BY a.run_id) a
WHERE r.run_id = a.run_id;

UPDATE run_totals r SET
    outputs = o.outputs, downloaded = o.downloaded, download_failures = o.failures
FROM (SELECT run_id, COUNT(*) AS outputs, COUNT(*) FILTER (WHERE path IS NOT NULL) AS downloaded,
             COUNT(*) FILTER (WHERE path IS NULL AND download_error IS NOT NULL) AS failures
      FROM outputs GROUP BY run_id) o
WHERE r.run_id = o.run_id;

-- Tasks: a row counts in its step's totals while it is live. (PostgreSQL takes transition
-- tables only on triggers of one event and without a column list: three triggers a table.)

CREATE FUNCTION tasks_totals_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO run_step_totals AS s (run_id, step, part, first_id, tasks, succeeded, failed,
                                      blocked, pending, planned_credits, billed_credits)
    SELECT run_id, step, 0, MIN(first_id), SUM(tasks), SUM(succeeded), SUM(failed), SUM(blocked),
           SUM(pending), SUM(planned_credits), SUM(billed_credits)
    FROM (SELECT n.run_id, n.step, n.id AS first_id,
                   CASE WHEN n.removed_at IS NULL THEN 1 ELSE 0 END AS tasks,
                   CASE WHEN n.removed_at IS NULL AND n.status = 'succeeded' THEN 1 ELSE 0 END AS succeeded,
                   CASE WHEN n.removed_at IS NULL AND n.status = 'failed' THEN 1 ELSE 0 END AS failed,
                   CASE WHEN n.removed_at IS NULL AND n.status = 'blocked' THEN 1 ELSE 0 END AS blocked,
                   CASE WHEN n.removed_at IS NULL AND n.status IN ('pending', 'running') THEN 1 ELSE 0 END
                       AS pending,
                   CASE WHEN n.removed_at IS NULL THEN n.planned_credits ELSE 0 END AS planned_credits,
                   CASE WHEN n.removed_at IS NULL THEN n.credits_billed ELSE 0 END AS billed_credits
            FROM new_rows n) d
    GROUP BY run_id, step
    HAVING SUM(tasks) <> 0 OR SUM(succeeded) <> 0 OR SUM(failed) <> 0 OR SUM(blocked) <> 0
        OR SUM(pending) <> 0 OR SUM(planned_credits) <> 0 OR SUM(billed_credits) <> 0
    ORDER BY run_id, step
    ON CONFLICT (run_id, step, part) DO UPDATE SET
        first_id = LEAST(s.first_id, excluded.first_id),
        tasks = s.tasks + excluded.tasks,
        succeeded = s.succeeded + excluded.succeeded,
        failed = s.failed + excluded.failed,
        blocked = s.blocked + excluded.blocked,
        pending = s.pending + excluded.pending,
        planned_credits = s.planned_credits + excluded.planned_credits,
        billed_credits = s.billed_credits + excluded.billed_credits;
    RETURN NULL;
END
$$;

CREATE TRIGGER tasks_totals_insert AFTER INSERT ON tasks
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION tasks_totals_insert();

CREATE FUNCTION tasks_totals_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO run_step_totals AS s (run_id, step, part, first_id, tasks, succeeded, failed,
                                      blocked, pending, planned_credits, billed_credits)
    SELECT run_id, step, 1, MIN(first_id), SUM(tasks), SUM(succeeded), SUM(failed), SUM(blocked),
           SUM(pending), SUM(planned_credits), SUM(billed_credits)
    FROM (SELECT n.run_id, n.step, n.id AS first_id,
                   CASE WHEN n.removed_at IS NULL THEN 1 ELSE 0 END AS tasks,
                   CASE WHEN n.removed_at IS NULL AND n.status = 'succeeded' THEN 1 ELSE 0 END AS succeeded,
                   CASE WHEN n.removed_at IS NULL AND n.status = 'failed' THEN 1 ELSE 0 END AS failed,
                   CASE WHEN n.removed_at IS NULL AND n.status = 'blocked' THEN 1 ELSE 0 END AS blocked,
                   CASE WHEN n.removed_at IS NULL AND n.status IN ('pending', 'running') THEN 1 ELSE 0 END
                       AS pending,
                   CASE WHEN n.removed_at IS NULL THEN n.planned_credits ELSE 0 END AS planned_credits,
                   CASE WHEN n.removed_at IS NULL THEN n.credits_billed ELSE 0 END AS billed_credits
            FROM new_rows n
            UNION ALL
            SELECT o.run_id, o.step, o.id AS first_id,
                   -CASE WHEN o.removed_at IS NULL THEN 1 ELSE 0 END AS tasks,
                   -CASE WHEN o.removed_at IS NULL AND o.status = 'succeeded' THEN 1 ELSE 0 END AS succeeded,
                   -CASE WHEN o.removed_at IS NULL AND o.status = 'failed' THEN 1 ELSE 0 END AS failed,
                   -CASE WHEN o.removed_at IS NULL AND o.status = 'blocked' THEN 1 ELSE 0 END AS blocked,
                   -CASE WHEN o.removed_at IS NULL AND o.status IN ('pending', 'running') THEN 1 ELSE 0 END
                       AS pending,
                   -CASE WHEN o.removed_at IS NULL THEN o.planned_credits ELSE 0 END AS planned_credits,
                   -CASE WHEN o.removed_at IS NULL THEN o.credits_billed ELSE 0 END AS billed_credits
            FROM old_rows o) d
    GROUP BY run_id, step
    HAVING SUM(tasks) <> 0 OR SUM(succeeded) <> 0 OR SUM(failed) <> 0 OR SUM(blocked) <> 0
        OR SUM(pending) <> 0 OR SUM(planned_credits) <> 0 OR SUM(billed_credits) <> 0
    ORDER BY run_id, step
    ON CONFLICT (run_id, step, part) DO UPDATE SET
        first_id = LEAST(s.first_id, excluded.first_id),
        tasks = s.tasks + excluded.tasks,
        succeeded = s.succeeded + excluded.succeeded,
        failed = s.failed + excluded.failed,
        blocked = s.blocked + excluded.blocked,
        pending = s.pending + excluded.pending,
        planned_credits = s.planned_credits + excluded.planned_credits,
        billed_credits = s.billed_credits + excluded.billed_credits;
    -- A task's planned credits are what its unanswered attempts may have cost. Asked first
    -- of the statement's own rows, so that the attempts are read only when a price changed.
    IF EXISTS (SELECT 1 FROM new_rows n JOIN old_rows o ON o.id = n.id
               WHERE n.planned_credits <> o.planned_credits) THEN
        UPDATE run_totals r SET possibly_billed_credits = r.possibly_billed_credits + d.delta
        FROM (SELECT a.run_id, SUM(n.planned_credits - o.planned_credits) AS delta
              FROM new_rows n JOIN old_rows o ON o.id = n.id
              JOIN attempts a ON a.task_id = n.id
                  AND (a.outcome IS NULL OR a.outcome = 'ambiguous')
              WHERE n.planned_credits <> o.planned_credits
              GROUP BY a.run_id) d
        WHERE r.run_id = d.run_id AND d.delta <> 0;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER tasks_totals_update AFTER UPDATE ON tasks
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION tasks_totals_update();

CREATE FUNCTION tasks_totals_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO run_step_totals AS s (run_id, step, part, first_id, tasks, succeeded, failed,
                                      blocked, pending, planned_credits, billed_credits)
    SELECT run_id, step, 1, MIN(first_id), SUM(tasks), SUM(succeeded), SUM(failed), SUM(blocked),
           SUM(pending), SUM(planned_credits), SUM(billed_credits)
    FROM (SELECT o.run_id, o.step, o.id AS first_id,
                   -CASE WHEN o.removed_at IS NULL THEN 1 ELSE 0 END AS tasks,
                   -CASE WHEN o.removed_at IS NULL AND o.status = 'succeeded' THEN 1 ELSE 0 END AS succeeded,
                   -CASE WHEN o.removed_at IS NULL AND o.status = 'failed' THEN 1 ELSE 0 END AS failed,
                   -CASE WHEN o.removed_at IS NULL AND o.status = 'blocked' THEN 1 ELSE 0 END AS blocked,
                   -CASE WHEN o.removed_at IS NULL AND o.status IN ('pending', 'running') THEN 1 ELSE 0 END
                       AS pending,
                   -CASE WHEN o.removed_at IS NULL THEN o.planned_credits ELSE 0 END AS planned_credits,
                   -CASE WHEN o.removed_at IS NULL THEN o.credits_billed ELSE 0 END AS billed_credits
            FROM old_rows o) d
    GROUP BY run_id, step
    HAVING SUM(tasks) <> 0 OR SUM(succeeded) <> 0 OR SUM(failed) <> 0 OR SUM(blocked) <> 0
        OR SUM(pending) <> 0 OR SUM(planned_credits) <> 0 OR SUM(billed_credits) <> 0
    ORDER BY run_id, step
    ON CONFLICT (run_id, step, part) DO UPDATE SET
        first_id = LEAST(s.first_id, excluded.first_id),
        tasks = s.tasks + excluded.tasks,
        succeeded = s.succeeded + excluded.succeeded,
        failed = s.failed + excluded.failed,
        blocked = s.blocked + excluded.blocked,
        pending = s.pending + excluded.pending,
        planned_credits = s.planned_credits + excluded.planned_credits,
        billed_credits = s.billed_credits + excluded.billed_credits;
    RETURN NULL;
END
$$;

CREATE TRIGGER tasks_totals_delete AFTER DELETE ON tasks
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION tasks_totals_delete();

-- Attempts: credits billed, and those that may have been billed without an answer.

CREATE FUNCTION attempts_totals_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO run_totals AS r (run_id, billed_credits, ambiguous_attempts,
                                 possibly_billed_credits)
    SELECT run_id, SUM(billed), SUM(ambiguous), SUM(possibly)
    FROM (SELECT a.run_id, a.credits_billed AS billed,
                   CASE WHEN (a.outcome IS NULL OR a.outcome = 'ambiguous')
                        THEN 1 ELSE 0 END AS ambiguous,
                   CASE WHEN (a.outcome IS NULL OR a.outcome = 'ambiguous') 
                        THEN COALESCE((SELECT t.planned_credits FROM tasks t
                                       WHERE t.id = a.task_id), 0)
                        ELSE 0 END AS possibly
            FROM new_rows a) d
    GROUP BY run_id
    HAVING SUM(billed) <> 0 OR SUM(ambiguous) <> 0 OR SUM(possibly) <> 0
    ORDER BY run_id
    ON CONFLICT (run_id) DO UPDATE SET
        billed_credits = r.billed_credits + excluded.billed_credits,
        ambiguous_attempts = r.ambiguous_attempts + excluded.ambiguous_attempts,
        possibly_billed_credits = r.possibly_billed_credits + excluded.possibly_billed_credits;
    RETURN NULL;
END
$$;

CREATE TRIGGER attempts_totals_insert AFTER INSERT ON attempts
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION attempts_totals_insert();

CREATE FUNCTION attempts_totals_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO run_totals AS r (run_id, billed_credits, ambiguous_attempts,
                                 possibly_billed_credits)
    SELECT run_id, SUM(billed), SUM(ambiguous), SUM(possibly)
    FROM (SELECT a.run_id, a.credits_billed AS billed,
                   CASE WHEN (a.outcome IS NULL OR a.outcome = 'ambiguous')
                        THEN 1 ELSE 0 END AS ambiguous,
                   CASE WHEN (a.outcome IS NULL OR a.outcome = 'ambiguous') 
                        THEN COALESCE((SELECT t.planned_credits FROM tasks t
                                       WHERE t.id = a.task_id), 0)
                        ELSE 0 END AS possibly
            FROM new_rows a
            UNION ALL
            SELECT a.run_id, -a.credits_billed AS billed,
                   -CASE WHEN (a.outcome IS NULL OR a.outcome = 'ambiguous')
                        THEN 1 ELSE 0 END AS ambiguous,
                   -CASE WHEN (a.outcome IS NULL OR a.outcome = 'ambiguous') 
                        THEN COALESCE((SELECT t.planned_credits FROM tasks t
                                       WHERE t.id = a.task_id), 0)
                        ELSE 0 END AS possibly
            FROM old_rows a) d
    GROUP BY run_id
    HAVING SUM(billed) <> 0 OR SUM(ambiguous) <> 0 OR SUM(possibly) <> 0
    ORDER BY run_id
    ON CONFLICT (run_id) DO UPDATE SET
        billed_credits = r.billed_credits + excluded.billed_credits,
        ambiguous_attempts = r.ambiguous_attempts + excluded.ambiguous_attempts,
        possibly_billed_credits = r.possibly_billed_credits + excluded.possibly_billed_credits;
    RETURN NULL;
END
$$;

CREATE TRIGGER attempts_totals_update AFTER UPDATE ON attempts
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION attempts_totals_update();

CREATE FUNCTION attempts_totals_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO run_totals AS r (run_id, billed_credits, ambiguous_attempts,
                                 possibly_billed_credits)
    SELECT run_id, SUM(billed), SUM(ambiguous), SUM(possibly)
    FROM (SELECT a.run_id, -a.credits_billed AS billed,
                   -CASE WHEN (a.outcome IS NULL OR a.outcome = 'ambiguous')
                        THEN 1 ELSE 0 END AS ambiguous,
                   -CASE WHEN (a.outcome IS NULL OR a.outcome = 'ambiguous') 
                        THEN COALESCE((SELECT t.planned_credits FROM tasks t
                                       WHERE t.id = a.task_id), 0)
                        ELSE 0 END AS possibly
            FROM old_rows a) d
    GROUP BY run_id
    HAVING SUM(billed) <> 0 OR SUM(ambiguous) <> 0 OR SUM(possibly) <> 0
    ORDER BY run_id
    ON CONFLICT (run_id) DO UPDATE SET
        billed_credits = r.billed_credits + excluded.billed_credits,
        ambiguous_attempts = r.ambiguous_attempts + excluded.ambiguous_attempts,
        possibly_billed_credits = r.possibly_billed_credits + excluded.possibly_billed_credits;
    RETURN NULL;
END
$$;

CREATE TRIGGER attempts_totals_delete AFTER DELETE ON attempts
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION attempts_totals_delete();

-- Outputs: all, those with a file or object, those whose download failed.

CREATE FUNCTION outputs_totals_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO run_totals AS r (run_id, outputs, downloaded, download_failures)
    SELECT run_id, SUM(outputs), SUM(downloaded), SUM(failures)
    FROM (SELECT o.run_id, 1 AS outputs,
                   CASE WHEN o.path IS NOT NULL THEN 1 ELSE 0 END AS downloaded,
                   CASE WHEN o.path IS NULL AND o.download_error IS NOT NULL THEN 1 ELSE 0 END
                       AS failures
            FROM new_rows o) d
    GROUP BY run_id
    HAVING SUM(outputs) <> 0 OR SUM(downloaded) <> 0 OR SUM(failures) <> 0
    ORDER BY run_id
    ON CONFLICT (run_id) DO UPDATE SET
        outputs = r.outputs + excluded.outputs,
        downloaded = r.downloaded + excluded.downloaded,
        download_failures = r.download_failures + excluded.download_failures;
    RETURN NULL;
END
$$;

CREATE TRIGGER outputs_totals_insert AFTER INSERT ON outputs
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION outputs_totals_insert();

CREATE FUNCTION outputs_totals_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO run_totals AS r (run_id, outputs, downloaded, download_failures)
    SELECT run_id, SUM(outputs), SUM(downloaded), SUM(failures)
    FROM (SELECT o.run_id, 1 AS outputs,
                   CASE WHEN o.path IS NOT NULL THEN 1 ELSE 0 END AS downloaded,
                   CASE WHEN o.path IS NULL AND o.download_error IS NOT NULL THEN 1 ELSE 0 END
                       AS failures
            FROM new_rows o
            UNION ALL
            SELECT o.run_id, -1 AS outputs,
                   -CASE WHEN o.path IS NOT NULL THEN 1 ELSE 0 END AS downloaded,
                   -CASE WHEN o.path IS NULL AND o.download_error IS NOT NULL THEN 1 ELSE 0 END
                       AS failures
            FROM old_rows o) d
    GROUP BY run_id
    HAVING SUM(outputs) <> 0 OR SUM(downloaded) <> 0 OR SUM(failures) <> 0
    ORDER BY run_id
    ON CONFLICT (run_id) DO UPDATE SET
        outputs = r.outputs + excluded.outputs,
        downloaded = r.downloaded + excluded.downloaded,
        download_failures = r.download_failures + excluded.download_failures;
    RETURN NULL;
END
$$;

CREATE TRIGGER outputs_totals_update AFTER UPDATE ON outputs
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION outputs_totals_update();

CREATE FUNCTION outputs_totals_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO run_totals AS r (run_id, outputs, downloaded, download_failures)
    SELECT run_id, SUM(outputs), SUM(downloaded), SUM(failures)
    FROM (SELECT o.run_id, -1 AS outputs,
                   -CASE WHEN o.path IS NOT NULL THEN 1 ELSE 0 END AS downloaded,
                   -CASE WHEN o.path IS NULL AND o.download_error IS NOT NULL THEN 1 ELSE 0 END
                       AS failures
            FROM old_rows o) d
    GROUP BY run_id
    HAVING SUM(outputs) <> 0 OR SUM(downloaded) <> 0 OR SUM(failures) <> 0
    ORDER BY run_id
    ON CONFLICT (run_id) DO UPDATE SET
        outputs = r.outputs + excluded.outputs,
        downloaded = r.downloaded + excluded.downloaded,
        download_failures = r.download_failures + excluded.download_failures;
    RETURN NULL;
END
$$;

CREATE TRIGGER outputs_totals_delete AFTER DELETE ON outputs
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION outputs_totals_delete();

-- `status` lists the attempts that may have been billed, and the failed downloads: few rows,
-- found without reading every attempt and output of the run.
CREATE INDEX attempts_unanswered ON attempts(run_id, id)
    WHERE outcome IS NULL OR outcome = 'ambiguous';
CREATE INDEX outputs_failed ON outputs(run_id, task_id, k)
    WHERE path IS NULL AND download_error IS NOT NULL;
