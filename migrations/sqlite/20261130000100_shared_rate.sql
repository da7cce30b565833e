-- The rate limit of an account, shared by every process that spends on it through this
-- database (issue 35). An account is a digest of the service's address and the API key, never
-- the key. Its row keeps the limit and the GCRA state: the theoretical arrival time (TAT) of
-- the next call, moved forward by one statement for each block of calls a process draws, and
-- a pause every process keeps after the service answered one of them 429. Times are unix
-- microseconds: on PostgreSQL the server's clock, on SQLite (one machine) the process's.
CREATE TABLE rate_accounts (
    account          TEXT PRIMARY KEY NOT NULL,
    -- The limit last told by a process that spends on it: microseconds between calls.
    interval_us      INTEGER NOT NULL CHECK (interval_us > 0),
    -- Calls that may go at once after a quiet spell.
    burst            INTEGER NOT NULL DEFAULT 1 CHECK (burst >= 1),
    tat_us           INTEGER NOT NULL DEFAULT 0,
    paused_until_us  INTEGER NOT NULL DEFAULT 0
);

-- The processes that draw from an account's limit: shown by `status` and `runs`, and counted
-- by a process that cannot reach the database to take its share of the limit.
CREATE TABLE rate_drawers (
    -- Host, pid and a random mark, as the caps' lease holders.
    holder       TEXT PRIMARY KEY NOT NULL,
    account      TEXT NOT NULL,
    run_id       TEXT NOT NULL,
    host         TEXT NOT NULL,
    pid          INTEGER NOT NULL,
    -- Unix milliseconds.
    started_at   INTEGER NOT NULL,
    last_seen    INTEGER NOT NULL,
    -- Calls drawn so far.
    drawn        INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX rate_drawers_by_account ON rate_drawers(account, last_seen);
