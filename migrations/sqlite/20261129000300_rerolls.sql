-- Rerolls (`imgpipe reroll RUN TASK...`): each is recorded in the one transaction that resets
-- its tasks, with what it named (`said`, its targets sorted) and the row ids it reset (a JSON
-- array). Until it ends with all of them done, the same command continues it instead of
-- resetting them again: a reroll killed half way pays nothing twice. Append-only.
CREATE TABLE rerolls (
    id           INTEGER PRIMARY KEY,
    run_id       TEXT NOT NULL REFERENCES runs(id),
    said         TEXT NOT NULL,
    task_ids     TEXT NOT NULL,
    created_at   INTEGER NOT NULL,   -- unix milliseconds
    finished_at  INTEGER
);

CREATE INDEX rerolls_by_run ON rerolls(run_id, said);
