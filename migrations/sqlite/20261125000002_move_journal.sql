-- The journal of a resume's file and object moves. A resume records, in the one transaction
-- that applies its review, each output it sets aside and the move that takes its file (or
-- object) from `from_path` to `to_path`; the move is made after the commit and its row deleted
-- once done. A process killed between the two leaves the row, and the next resume makes the
-- move before anything else (a move already made is found made). Append-only.

CREATE TABLE pending_moves (
    id              INTEGER PRIMARY KEY,
    run_id          TEXT NOT NULL REFERENCES runs(id),
    superseded_id   INTEGER NOT NULL REFERENCES superseded_outputs(id),
    from_path       TEXT NOT NULL,
    to_path         TEXT NOT NULL
);

CREATE INDEX pending_moves_by_run ON pending_moves(run_id);
