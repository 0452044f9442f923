-- Cache-aware routing (docs/affinity.md): how the call's affinity key placed it, as its
-- X-Router-Affinity header said: `hit:<kind>`, `miss:<kind>` or `none` (kind: session, key,
-- user, response, prefix); NULL with --affinity off. Never the key, a session id or a hash.
ALTER TABLE route_log ADD COLUMN affinity TEXT;
