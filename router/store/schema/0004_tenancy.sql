-- Tenancy (docs/tenancy.md): a key's limits, the tokens of each call, and each key's usage by
-- UTC day. Added beside 0.0.4's columns, so 0.0.4 (which names the columns it writes) keeps
-- working on the file. A limit NULL is no limit; `models` is a JSON array of names.
ALTER TABLE api_keys ADD COLUMN rpm INTEGER CHECK (rpm IS NULL OR rpm >= 1);
ALTER TABLE api_keys ADD COLUMN tpm INTEGER CHECK (tpm IS NULL OR tpm >= 1);
ALTER TABLE api_keys ADD COLUMN max_parallel INTEGER CHECK (max_parallel IS NULL OR max_parallel >= 1);
ALTER TABLE api_keys ADD COLUMN budget_tokens INTEGER CHECK (budget_tokens IS NULL OR budget_tokens >= 1);
ALTER TABLE api_keys ADD COLUMN budget_period TEXT NOT NULL DEFAULT 'day'
    CHECK (budget_period IN ('day', 'week', 'month'));
ALTER TABLE api_keys ADD COLUMN models TEXT;

-- The call's key (its id; 'admin' for HUGPY_ROUTER_KEY; NULL without a key) and its tokens as
-- the box reported them, or as estimated (tokens_estimated = 1) when it reported none.
ALTER TABLE route_log ADD COLUMN key_id TEXT;
ALTER TABLE route_log ADD COLUMN prompt_tokens INTEGER;
ALTER TABLE route_log ADD COLUMN completion_tokens INTEGER;
ALTER TABLE route_log ADD COLUMN cached_tokens INTEGER;
ALTER TABLE route_log ADD COLUMN tokens_estimated INTEGER;

-- A key's calls and tokens per UTC day (day = floor(epoch / 86400) of the call's end), written
-- by the route-log writer in the same transaction as the rows; pruned with them (retention).
CREATE TABLE key_usage (
    key_id            TEXT NOT NULL,
    day               INTEGER NOT NULL,
    requests          INTEGER NOT NULL DEFAULT 0,
    prompt_tokens     INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens     INTEGER NOT NULL DEFAULT 0,
    estimated         INTEGER NOT NULL DEFAULT 0,   -- calls whose tokens were estimated
    PRIMARY KEY (key_id, day)
) WITHOUT ROWID;
