-- Spending caps over calendar windows, shared by every run on every host that uses this
-- database, and the leases runs take against them. A run leases credits from each cap that
-- covers it before it commits them to a chain; a window has spent the credits of its open
-- leases and what its closed leases used. A lease whose holder stopped beating is closed by
-- the next run that leases, with what its run was billed (or possibly billed) since it opened.
CREATE TABLE caps (
    name         TEXT PRIMARY KEY NOT NULL,
    credits      INTEGER NOT NULL CHECK (credits > 0),
    per          TEXT NOT NULL CHECK (per IN ('day', 'week', 'month')),
    -- NULL: every pipeline.
    pipeline     TEXT,
    -- The IANA time zone the windows are counted in.
    tz           TEXT NOT NULL,
    created_at   INTEGER NOT NULL
);

CREATE TABLE cap_leases (
    id           INTEGER PRIMARY KEY,
    -- No reference to caps: a cap removed and set again keeps its windows' history.
    cap          TEXT NOT NULL,
    -- Unix milliseconds, the start of the window the credits were leased from.
    window_start INTEGER NOT NULL,
    run_id       TEXT NOT NULL,
    -- The process holding the lease: host, pid and a random mark.
    holder       TEXT NOT NULL,
    credits      INTEGER NOT NULL,
    -- What the lease was used for, once closed.
    used         INTEGER NOT NULL DEFAULT 0,
    open         INTEGER NOT NULL DEFAULT 1,
    opened_at    INTEGER NOT NULL,
    heartbeat_at INTEGER NOT NULL
);
CREATE INDEX cap_leases_by_window ON cap_leases(cap, window_start);
CREATE INDEX cap_leases_open ON cap_leases(cap, open, heartbeat_at);
-- What a run whose holder died was billed since its lease opened.
CREATE INDEX attempts_by_run_time ON attempts(run_id, started_at);
