-- Held for another branch's migration of this number (the session's numbering: tenancy is
-- 0006); a no-op so that 1..N has no gap on this branch. Replaced by that branch's file at merge.
SELECT 1;
