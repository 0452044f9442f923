"""Simulated boxes for the demo, the tests and the benchmark: a hugpy-wrapper box
(`router.sim.hugpy`), an Ollama server (`router.sim.ollama`) and an LM Studio server
(`router.sim.lmstudio`), on the shared plumbing of `router.sim.server`."""

from router.sim.hugpy import SimBox
from router.sim.lmstudio import SimLMStudio
from router.sim.ollama import SimOllama
from router.sim.server import Behavior, CallRecord, SimFleet

__all__ = ["Behavior", "CallRecord", "SimBox", "SimFleet", "SimLMStudio", "SimOllama"]
