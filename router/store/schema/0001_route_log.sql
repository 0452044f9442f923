-- One row per call, written by the route_log writer thread (router/store/route_log.py).
-- decision: JSON {ranked boxes, reasons}; attempts: JSON list of {box, status, refusal, ms}.
-- Times are epoch seconds; state follows the call's lifecycle ('pending' while in flight).
CREATE TABLE route_log (
    id            INTEGER PRIMARY KEY,
    call_id       TEXT NOT NULL UNIQUE,
    facade        TEXT,
    route         TEXT,
    model         TEXT,
    settings      TEXT,
    pin           TEXT,
    client        TEXT,
    stream        INTEGER,
    decision_path TEXT,
    decision      TEXT,
    attempts      TEXT,
    box           TEXT,
    status        INTEGER,
    state         TEXT NOT NULL
                  CHECK (state IN ('pending', 'done', 'failed', 'refused', 'cancelled')),
    error         TEXT,
    received_at   REAL,
    first_byte_at REAL,
    done_at       REAL,
    bytes_in      INTEGER,
    bytes_out     INTEGER
);

-- The admin API and the UI read recent calls and calls per box.
CREATE INDEX route_log_received_at ON route_log (received_at);
CREATE INDEX route_log_box ON route_log (box);
