-- Indexes for reading a large run without sorting its whole task table: `status` counts tasks
-- per step, and `report` walks a run item by item. Append-only, like every migration.

-- Per-step counts read the index in step order (no temporary sort of every task) and take the
-- counted columns from it, never touching the table.
CREATE INDEX tasks_by_step ON tasks(run_id, step, removed_at, status, planned_credits, credits_billed);
