-- PostgreSQL only: who holds each pipeline's run lock. The lock itself is an advisory lock held
-- by the run's own session (released by the server when the session ends, however the process
-- died); this row only names its holder for the host that finds it taken. Append-only.

CREATE TABLE run_locks (
    lock_key  BIGINT PRIMARY KEY,
    pipeline  TEXT NOT NULL,
    run_id    TEXT NOT NULL,
    host      TEXT NOT NULL,
    pid       BIGINT NOT NULL,
    since     TEXT NOT NULL
);
