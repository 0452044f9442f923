-- OpenAI's Batch API (docs/batches.md, router/store/batches.py): the SQLite store's migration
-- 0007 in PostgreSQL's types, with the same names and meanings: the uploaded and written files,
-- the batches, and each batch's lines with their leases and results. Times are epoch seconds.
-- `owner` is a key id ('admin' for HUGPY_ROUTER_KEY) or 'inside' (callers without a key).
CREATE TABLE batch_files (
    id         text PRIMARY KEY,            -- file-<24 hex>
    owner      text NOT NULL,
    purpose    text NOT NULL,               -- batch (uploaded) | batch_output (written)
    filename   text,
    bytes      bigint NOT NULL,
    created_at double precision NOT NULL,
    content    bytea NOT NULL
);
CREATE INDEX batch_files_listed ON batch_files (created_at, id);

CREATE TABLE batches (
    id                text PRIMARY KEY,     -- batch_<24 hex>
    owner             text NOT NULL,
    endpoint          text NOT NULL,
    input_file_id     text NOT NULL,
    completion_window text NOT NULL,
    status            text NOT NULL CHECK (status IN ('validating', 'failed', 'in_progress',
                          'finalizing', 'completed', 'expired', 'cancelling', 'cancelled')),
    created_at        double precision NOT NULL,
    expires_at        double precision NOT NULL,
    in_progress_at    double precision,
    finalizing_at     double precision,
    completed_at      double precision,
    failed_at         double precision,
    expired_at        double precision,
    cancelling_at     double precision,
    cancelled_at      double precision,
    total             bigint NOT NULL DEFAULT 0,
    completed         bigint NOT NULL DEFAULT 0,
    failed            bigint NOT NULL DEFAULT 0,
    prompt_tokens     bigint NOT NULL DEFAULT 0,
    completion_tokens bigint NOT NULL DEFAULT 0,
    cached_tokens     bigint NOT NULL DEFAULT 0,
    output_file_id    text,
    error_file_id     text,
    errors            text,                 -- JSON: OpenAI's errors object, when validation failed
    metadata          text                  -- JSON: the caller's string pairs
);
CREATE INDEX batches_listed ON batches (created_at, id);
CREATE INDEX batches_status ON batches (status);

-- A line runs on one router at a time: `lease_owner` (its instance name) until `lease_until`;
-- a lease that ran out (a dead router's) is taken by another. `waiting_on`: the refusal code
-- that last put the line back. `result`: one JSON line of the output or error file, no newline.
CREATE TABLE batch_lines (
    batch_id          text NOT NULL,
    line_no           integer NOT NULL,     -- the input file's line, 1-based
    custom_id         text NOT NULL,
    body              bytea NOT NULL,
    state             text NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'running', 'done')),
    attempts          integer NOT NULL DEFAULT 0,
    lease_owner       text,
    lease_until       double precision,
    not_before        double precision NOT NULL DEFAULT 0,
    waiting_on        text,
    result_kind       text CHECK (result_kind IS NULL OR result_kind IN ('output', 'error')),
    result            bytea,
    prompt_tokens     bigint,
    completion_tokens bigint,
    cached_tokens     bigint,
    finished_at       double precision,
    PRIMARY KEY (batch_id, line_no)
);
-- The lines a lease looks through: only the unfinished, in line order, so a batch nearly done
-- costs a lease what is left of it, not the whole batch.
CREATE INDEX batch_lines_open ON batch_lines (batch_id, line_no) WHERE state <> 'done';
CREATE INDEX batch_lines_leased ON batch_lines (lease_owner) WHERE state = 'running';

-- A batch line's call: its batch and the line's custom_id (NULL for every other call).
ALTER TABLE route_log ADD COLUMN batch_id text;
ALTER TABLE route_log ADD COLUMN custom_id text;
CREATE INDEX route_log_batch ON route_log (batch_id) WHERE batch_id IS NOT NULL;
