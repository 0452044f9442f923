-- The router's API keys, as hugpy-wrapper's migration 0002 (contracts/hugpy-wrapper.md §6).
-- Only sha256(secret) is kept; a full key is shown once, at creation. Times are epoch seconds.
CREATE TABLE api_keys (
    id           TEXT PRIMARY KEY,
    name         TEXT NOT NULL,
    scope        TEXT NOT NULL CHECK (scope IN ('use', 'admin')),
    secret_hash  TEXT NOT NULL,
    created_at   REAL NOT NULL,
    created_by   TEXT,
    expires_at   REAL,
    last_used_at REAL,
    revoked_at   REAL
);
