"""Several routers on one Redis-protocol server (docs/several-routers.md): the wire to it
(`wire`), the keys' tallies (`tallies`), the boxes' slots as leases and the routers' heartbeat
(`leases`), and the affinity bindings (`bindings`). One router never imports this room's
engines: the call meets them only through serve/fleetwide.py's seam."""
