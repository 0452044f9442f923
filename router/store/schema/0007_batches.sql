-- OpenAI's Batch API (docs/batches.md, router/store/batches.py): the uploaded and written files,
-- the batches, and each batch's lines with their leases and results. Times are epoch seconds.
-- `owner` is a key id ('admin' for HUGPY_ROUTER_KEY) or 'inside' (callers without a key).
CREATE TABLE batch_files (
    id         TEXT PRIMARY KEY,            -- file-<24 hex>
    owner      TEXT NOT NULL,
    purpose    TEXT NOT NULL,               -- batch (uploaded) | batch_output (written)
    filename   TEXT,
    bytes      INTEGER NOT NULL,
    created_at REAL NOT NULL,
    content    BLOB NOT NULL
);
CREATE INDEX batch_files_listed ON batch_files (created_at, id);

CREATE TABLE batches (
    id                TEXT PRIMARY KEY,     -- batch_<24 hex>
    owner             TEXT NOT NULL,
    endpoint          TEXT NOT NULL,
    input_file_id     TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status            TEXT NOT NULL CHECK (status IN ('validating', 'failed', 'in_progress',
                          'finalizing', 'completed', 'expired', 'cancelling', 'cancelled')),
    created_at        REAL NOT NULL,
    expires_at        REAL NOT NULL,
    in_progress_at    REAL,
    finalizing_at     REAL,
    completed_at      REAL,
    failed_at         REAL,
    expired_at        REAL,
    cancelling_at     REAL,
    cancelled_at      REAL,
    total             INTEGER NOT NULL DEFAULT 0,
    completed         INTEGER NOT NULL DEFAULT 0,
    failed            INTEGER NOT NULL DEFAULT 0,
    prompt_tokens     INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens     INTEGER NOT NULL DEFAULT 0,
    output_file_id    TEXT,
    error_file_id     TEXT,
    errors            TEXT,                 -- JSON: OpenAI's errors object, when validation failed
    metadata          TEXT                  -- JSON: the caller's string pairs
);
CREATE INDEX batches_listed ON batches (created_at, id);
CREATE INDEX batches_status ON batches (status);

-- A line runs on one router at a time: `lease_owner` (its instance name) until `lease_until`;
-- a lease that ran out (a dead router's) is taken by another. `waiting_on`: the refusal code
-- that last put the line back. `result`: one JSON line of the output or error file, no newline.
CREATE TABLE batch_lines (
    batch_id          TEXT NOT NULL,
    line_no           INTEGER NOT NULL,     -- the input file's line, 1-based
    custom_id         TEXT NOT NULL,
    body              BLOB NOT NULL,
    state             TEXT NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'running', 'done')),
    attempts          INTEGER NOT NULL DEFAULT 0,
    lease_owner       TEXT,
    lease_until       REAL,
    not_before        REAL NOT NULL DEFAULT 0,
    waiting_on        TEXT,
    result_kind       TEXT CHECK (result_kind IS NULL OR result_kind IN ('output', 'error')),
    result            BLOB,
    prompt_tokens     INTEGER,
    completion_tokens INTEGER,
    cached_tokens     INTEGER,
    finished_at       REAL,
    PRIMARY KEY (batch_id, line_no)
);
-- The lines a lease looks through: only the unfinished, in line order, so a batch nearly done
-- costs a lease what is left of it, not the whole batch.
CREATE INDEX batch_lines_open ON batch_lines (batch_id, line_no) WHERE state <> 'done';
CREATE INDEX batch_lines_leased ON batch_lines (lease_owner) WHERE state = 'running';

-- A batch line's call: its batch and the line's custom_id (NULL for every other call).
ALTER TABLE route_log ADD COLUMN batch_id TEXT;
ALTER TABLE route_log ADD COLUMN custom_id TEXT;
CREATE INDEX route_log_batch ON route_log (batch_id) WHERE batch_id IS NOT NULL;
