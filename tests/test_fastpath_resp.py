"""`_fastpath.resp_commands` (router/_fastpath_resp.pxi) against its model, hiredis' packer:
byte for byte the same RESP for random round trips of commands, and the same refusal of an
argument RESP has no form for."""

from __future__ import annotations

import hiredis
import pytest
from hypothesis import given
from hypothesis import strategies as st

from router._fastpath import resp_commands

ARGUMENT = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=100),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=False, allow_infinity=False),
)
COMMANDS = st.lists(st.tuples(st.sampled_from(["EVALSHA", "GET", "SET"]), *[ARGUMENT] * 2)
                    | st.lists(ARGUMENT, min_size=1, max_size=12).map(tuple), max_size=40)


@given(COMMANDS)
def test_resp_commands_writes_what_hiredis_packs(commands):
    assert resp_commands(commands) == b"".join(hiredis.pack_command(command) for command in commands)


def test_resp_commands_examples():
    assert resp_commands([]) == b""
    assert resp_commands([("PING",)]) == b"*1\r\n$4\r\nPING\r\n"
    assert resp_commands([("SET", "k", b""), ("EVALSHA", "s" * 40, 1, "é", 12)]) == (
        b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$0\r\n\r\n"
        b"*5\r\n$7\r\nEVALSHA\r\n$40\r\n" + b"s" * 40 + b"\r\n$1\r\n1\r\n$2\r\n\xc3\xa9\r\n$2\r\n12\r\n")


@pytest.mark.parametrize("argument", [None, True, [1], {"a": 1}, object()])
def test_an_argument_resp_has_no_form_for_is_refused_as_hiredis_refuses_it(argument):
    with pytest.raises(TypeError):
        hiredis.pack_command(("SET", "k", argument))
    with pytest.raises(TypeError):
        resp_commands([("SET", "k", argument)])
