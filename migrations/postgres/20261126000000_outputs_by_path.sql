-- The run's stored outputs in the byte order of their path (COLLATE "C": the order S3 lists keys
-- in, whatever the database's collation), read a page at a time from where the last page ended:
-- a resume checks the kept outputs beside the executor, in short statements, and each page is a
-- seek in this index rather than a sort of the run's outputs. Partial, like the query. The pages
-- are read with sorts disabled: on a table not analysed yet the planner guesses fewer rows than
-- a page and would rather sort them all (see `Store::stored_outputs`).
CREATE INDEX outputs_by_path ON outputs(run_id, path COLLATE "C", id) WHERE path IS NOT NULL;
