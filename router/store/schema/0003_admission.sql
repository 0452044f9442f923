-- Admission control: a key's priority class (the highest its calls wait in; a call may ask
-- for lower) and how long each call waited in the router's queue for a box with room. Added
-- beside 0.0.4's columns with a default, so 0.0.4 (which names the columns it writes) keeps
-- working on the file.
ALTER TABLE api_keys ADD COLUMN priority TEXT NOT NULL DEFAULT 'normal'
    CHECK (priority IN ('high', 'normal', 'low'));
ALTER TABLE route_log ADD COLUMN waited_ms REAL;
