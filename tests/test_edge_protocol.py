"""The edges implement the Edge protocol (router/serve/edge.py) with the same signatures: the two
interfaces' and a batch line's (router/serve/batches.py)."""

from __future__ import annotations

import inspect

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router._fastpath import header_map
from router.serve.batches import LineEdge
from router.serve.edge import AsgiEdge, Edge, RsgiEdge

MEMBERS = [name for name in vars(Edge) if not name.startswith("_")]
ATTRIBUTES = list(Edge.__annotations__)


@pytest.mark.parametrize("edge", [AsgiEdge, RsgiEdge, LineEdge])
def test_each_edge_has_every_method_of_the_protocol_with_its_signature(edge):
    for name in MEMBERS:
        want = inspect.signature(getattr(Edge, name))
        got = inspect.signature(getattr(edge, name))
        assert list(got.parameters) == list(want.parameters), name
        assert inspect.iscoroutinefunction(getattr(edge, name)) == inspect.iscoroutinefunction(getattr(Edge, name))
    for name in ATTRIBUTES:
        assert name in edge.__slots__, name


_HEADER_BYTES = st.binary(max_size=12)


@given(st.lists(st.tuples(st.sampled_from([b"a", b"host", b"x-\xe9"]) | _HEADER_BYTES, _HEADER_BYTES), max_size=8))
def test_header_map_against_the_plain_model(headers):
    """AsgiEdge's `headers` (the compiled header_map) is the plain comprehension it replaced:
    every byte as latin-1, the last line of a repeated name kept."""
    assert header_map(headers) == {k.decode("latin-1"): v.decode("latin-1") for k, v in headers}


def test_an_asgi_edge_reads_its_headers_by_name():
    scope = {"method": "POST", "path": "/", "query_string": b"", "client": ("127.0.0.1", 5),
             "headers": [(b"content-type", b"application/json"), (b"x-a", b"1"), (b"x-a", b"\xe9")]}
    edge = AsgiEdge(scope, None, None)
    assert (edge.header("content-type"), edge.header("x-a"), edge.header("none")) == ("application/json", "\xe9", None)
    assert edge.header_lines("x-a") == "1,\xe9"
