-- What this router records beside 0.0.4's columns: added, never renamed or dropped, so that
-- 0.0.4 (which names every column it writes) keeps working on the file. A 0.0.x store takes
-- this step in one transaction at the first start, old rows keeping NULL here.
ALTER TABLE route_log ADD COLUMN facade TEXT;       -- openai | ollama | lmstudio
ALTER TABLE route_log ADD COLUMN stream INTEGER;    -- 1 when the call asked for a stream
ALTER TABLE route_log ADD COLUMN bytes_in INTEGER;  -- the request body's size

-- The call lifecycle's states only (0.0.4 writes a subset of them). A trigger, since SQLite
-- cannot add a CHECK to an existing table, and 0.0.4's table must stay as it is.
CREATE TRIGGER route_log_state_insert BEFORE INSERT ON route_log
WHEN NEW.state NOT IN ('pending', 'done', 'failed', 'refused', 'cancelled')
BEGIN SELECT RAISE(ABORT, 'route_log.state is not a call state'); END;
