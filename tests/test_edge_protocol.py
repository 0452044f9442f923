"""Both edges implement the Edge protocol (router/serve/edge.py) with the same signatures."""

from __future__ import annotations

import inspect

import pytest

from router.serve.edge import AsgiEdge, Edge, RsgiEdge

MEMBERS = [name for name in vars(Edge) if not name.startswith("_")]
ATTRIBUTES = list(Edge.__annotations__)


@pytest.mark.parametrize("edge", [AsgiEdge, RsgiEdge])
def test_each_edge_has_every_method_of_the_protocol_with_its_signature(edge):
    for name in MEMBERS:
        want = inspect.signature(getattr(Edge, name))
        got = inspect.signature(getattr(edge, name))
        assert list(got.parameters) == list(want.parameters), name
        assert inspect.iscoroutinefunction(getattr(edge, name)) == inspect.iscoroutinefunction(getattr(Edge, name))
    for name in ATTRIBUTES:
        assert name in edge.__slots__, name
