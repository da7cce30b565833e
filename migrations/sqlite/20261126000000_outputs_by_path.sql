-- The run's stored outputs in the byte order of their path (SQLite's default collation compares
-- bytes), read a page at a time from where the last page ended: a resume checks the kept
-- outputs beside the executor, so it reads in short statements rather than holding SQLite's one
-- connection, and each page is a seek in this index rather than a sort of the run's outputs.
CREATE INDEX outputs_by_path ON outputs(run_id, path, id) WHERE path IS NOT NULL;
