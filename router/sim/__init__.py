"""Simulated boxes for the demo, the tests and the benchmark (see `router.sim.hugpy`)."""

from router.sim.hugpy import Behavior, CallRecord, SimBox, SimFleet

__all__ = ["Behavior", "CallRecord", "SimBox", "SimFleet"]
