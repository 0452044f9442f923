"""The store on PostgreSQL (`--database-url` / HUGPY_ROUTER_DATABASE_URL), for several routers.

What moves there: the route log, the keys (with their limits and usage), the boxes registry and
the aliases, the batches (their files and lines), and the applied migrations. Each piece is the
SQLite store's own code behind a small engine interface (keys.KeyEngine, route_log.RouteLogWriter's
engine methods, batches.BatchEngine, boxes.config.Registry); this package holds only the PostgreSQL side of those seams. It needs
the `shared` extra (psycopg 3): a single router installs nothing of it.
"""
