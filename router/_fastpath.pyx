# cython: language_level=3
"""Compiled hot path: per-chunk and per-call arithmetic with no policy in it. One extension
module, this one; its pieces live by subject in the files it includes, each opening with its rules:

1. `Reservations` (_fastpath_reservations.pxi): the process-wide reservation table, stamped with
   the scheduler generation each reservation was counted against.
2. `FrameScanner` and `Relay` (_fastpath_stream.pxi): a box's SSE or NDJSON stream held until its
   first data frame is judged, then relayed to the client unchanged, its tail kept to tell a
   proper end from a box that died.
3. `json_members` and `form_field` (_fastpath_body.pxi): the routing fields of a request body
   found without building it (a large body without the GIL); `header_map`, an ASGI request's
   headers as the str mapping the router reads.
4. `prefix_chain` (_fastpath_prefix.pxi): the hash chain of a prompt's leading elements over their
   raw bytes, for cache-aware routing (router.core.affinity), and that routing's index
   (`AffinityIndex`).
5. `resp_commands` (_fastpath_resp.pxi): a round trip's commands to the shared server as RESP,
   as hiredis writes them, without its sprintf per length.
6. `Histogram` (_fastpath_histogram.pxi): a metric's bucket counts, observed with no Python frame.

Each piece's plain model is in tests/ (tests/models.py, tests/test_body.py) and property tests
run both; `IMPL` lets a test check that this compiled module is the one loaded.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.stdint cimport uint64_t
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memchr, memcmp, memcpy, memmove, memset


cdef extern from "string.h" nogil:
    void* memmem(const void* haystack, size_t haystack_len, const void* needle, size_t needle_len)

IMPL = "cython"

include "_fastpath_reservations.pxi"
include "_fastpath_stream.pxi"
include "_fastpath_body.pxi"
include "_fastpath_prefix.pxi"
include "_fastpath_resp.pxi"
include "_fastpath_histogram.pxi"
