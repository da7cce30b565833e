-- The report's and the desk's cost lines read the totals the store keeps of each step's live
-- tasks (`run_step_totals`), and apart only what summing cannot keep: the tasks removed from
-- the pipeline and those reused from an earlier run, each found through an index of its own,
-- so a run that has none (most) reads none, instead of counting its every task.
-- Append-only, like every migration.

CREATE INDEX tasks_removed_by_step
    ON tasks(run_id, step, status, planned_credits, credits_billed)
    WHERE removed_at IS NOT NULL;
CREATE INDEX tasks_reused_by_step ON tasks(run_id, step, removed_at)
    WHERE reused_from IS NOT NULL;
