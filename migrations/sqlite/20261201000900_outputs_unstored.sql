-- A takeover downloads, before its first paid call, the outputs a killed process paid for and
-- could not keep (no path recorded): a few rows of a night's hundreds of thousands. Through
-- the run's index alone they were found by reading every output of the run (1.13 s of a
-- takeover at 900,000 outputs, tables not analysed); through this one, only themselves.
-- `outputs_failed` (the failed downloads `status` lists) is a part of these, kept as it is.
-- Append-only, like every migration.

CREATE INDEX outputs_unstored ON outputs(run_id, task_id, k) WHERE path IS NULL;
