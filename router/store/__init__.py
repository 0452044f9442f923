"""The router's own store: one SQLite file (APSW) holding `route_log` and `api_keys`.

Rooms above (`serve`, `cli`) use it; it never imports `router.serve` or `router.facades`.
"""
