"""GPU telemetry: the local NVML scan, the `router agent` feed and its link, and the
source-aware cache that ages readings (the pressure maths is router/core/pressure.py).

This room never imports router.serve or router.facades."""
