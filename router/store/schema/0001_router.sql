-- hugpy-router 0.0.4's migration 0001, unchanged (its observability/schema/0001_router.sql):
-- a 0.0.x store is a file at user_version 1 with exactly these tables, so it continues with
-- 0002 like any other store, and a store migrated past 1 still serves 0.0.4 after a roll back
-- (0.0.4 skips migrations it does not know and reads and writes only these columns).
--
-- One row per call. request_id is the call's id (X-Hugpy-Router-Request-Id, and the box's
-- X-Hugpy-Parent-Request-Id); options the call's settings (model@options); path the
-- decision's path; decision JSON {ranked boxes, reasons}; attempts JSON [{box, status, ...}].
-- Times are epoch seconds; state follows the call's lifecycle ('pending' while in flight).
CREATE TABLE route_log (
    id            INTEGER PRIMARY KEY,
    request_id    TEXT NOT NULL UNIQUE,
    received_at   REAL NOT NULL,
    route         TEXT,
    model         TEXT,
    options       TEXT,
    pin           TEXT,
    client        TEXT,
    path          TEXT,                 -- pin | serving | load | refused
    decision      TEXT,
    attempts      TEXT,
    box           TEXT,                 -- the box that served it
    state         TEXT NOT NULL DEFAULT 'pending',   -- pending | done | failed | refused | cancelled
    http_status   INTEGER,
    error         TEXT,
    first_byte_at REAL,
    responded_at  REAL,
    bytes_out     INTEGER
);
CREATE INDEX route_log_received ON route_log (received_at);
CREATE INDEX route_log_box ON route_log (box, received_at);

-- The router's API keys, as hugpy-wrapper's migration 0002 (contracts/hugpy-wrapper.md §6).
-- Only sha256(secret) is kept; a full key is shown once, at creation.
CREATE TABLE api_keys (
    id           TEXT PRIMARY KEY,
    name         TEXT NOT NULL,
    scope        TEXT NOT NULL CHECK (scope IN ('use', 'admin')),
    secret_hash  TEXT NOT NULL,
    created_at   REAL NOT NULL DEFAULT ((julianday('now') - 2440587.5) * 86400.0),
    created_by   TEXT,
    expires_at   REAL,
    last_used_at REAL,
    revoked_at   REAL
);
