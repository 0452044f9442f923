"""Simulated boxes for the demo, the tests and the benchmark: a hugpy-wrapper box
(`router.sim.hugpy`), an Ollama server (`router.sim.ollama`), an LM Studio server
(`router.sim.lmstudio`) and a llama.cpp server (`router.sim.llamacpp`), on the shared plumbing
of `router.sim.server` (the box base), `router.sim.connection` (the wire) and
`router.sim.fleet` (boxes on a background thread)."""

from router.sim.behavior import Behavior
from router.sim.connection import CallRecord
from router.sim.fleet import SimFleet
from router.sim.hugpy import SimBox
from router.sim.llamacpp import SimLlamaCpp
from router.sim.lmstudio import SimLMStudio
from router.sim.ollama import SimOllama

__all__ = ["Behavior", "CallRecord", "SimBox", "SimFleet", "SimLMStudio", "SimLlamaCpp", "SimOllama"]
