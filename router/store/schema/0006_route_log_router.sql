-- Several routers (docs/several-routers.md): the router that served the call, by its instance
-- name (`--instance`, default host:port). Added beside 0.0.4's columns; old rows keep NULL.
ALTER TABLE route_log ADD COLUMN router TEXT;
