-- The spend ledger (`imgpipe spend`) reads attempts by when they were sent: a window of days is
-- a range of this index instead of a scan of every night's attempts. Only `started_at`, which
-- is never updated: settling an attempt (outcome, credits) does not rewrite an entry, so the
-- hot path pays one index insert per call and nothing more. A ledger of the whole history
-- scans the table, which is as fast (2,000,000 attempts: README's Benchmarks). Append-only.
CREATE INDEX attempts_by_start ON attempts(started_at);
-- Planned credits are counted on the day a run started: the runs of a window.
CREATE INDEX runs_by_created ON runs(created_at);
