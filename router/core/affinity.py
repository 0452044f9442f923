"""Cache-aware routing: a call's affinity key, what this router sent where, and how far affinity
may move a call inside the serving tier. Pure: no clock, no randomness that is not passed in.

Rules (tests/test_core_affinity.py pins each against the plain models in tests/models.py). The
index (rules 3, 7, 8) runs on every call with a key, so it is compiled
(router/_fastpath_prefix.pxi `AffinityIndex`, given MIN_PULL_DEPTH and BOUND_DEPTH from here;
the serve layer holds it): this module stays stdlib only.
1. The key, first present wins: a session header (SESSION_HEADERS, in that order), the body's
   `prompt_cache_key` (kind `key`), its `user`, the Responses API's `previous_response_id`
   (kind `response`: the box that answered that response), else the prompt by its prefix chain
   (kind `prefix`). None of these, or a prompt of fewer than MIN_PULL_DEPTH elements (it could
   neither pull nor leave a node: rule 3a): no key, and the decision is the seeds' order.
2. Scope. Every key is scoped per caller (its API key's id, else its resolved address) and per
   model: two callers never share a binding, nor a prefix (the hash chain's seed carries both).
3. The prefix chain h_1..h_n has one hash per leading element of the prompt (router._fastpath
   prefix_chain): a node at depth d stands for "this router sent that box a prompt whose first
   d elements are these". A node pulls a call only when
   a. d >= MIN_PULL_DEPTH: the first element alone (a system prompt every caller sends) never
      pulls;
   b. the node is not shared: once two prompts continued it differently it is a common
      preamble, not one conversation's history;
   c. the box's cache for that model is the one the node was recorded under (`epoch`): the
      model unloaded, reloaded with other settings, or the box restarted, drops it.
   The deepest node found decides; a shared or stale one means no pull.
4. Placement (`place`). Only inside the serving tier, after the gate, the pin, the tiers and the
   seeds' rank have done their work: the pulled box goes first while its load (router.core.decide
   `rank_key`'s, the rank's own units) is within the slack of the best serving box's:
   load <= best + absolute + relative * best. Among several pulled boxes the deepest match wins,
   then the rank. A bound key (session, key, user, response) pulls harder than any prefix.
5. A miss (a key, but no pulled box within the slack) goes to the least-loaded serving box; boxes
   tied on (load, pressure) are chosen among by `spin` (random, passed in), so misses never pile
   onto one box.
6. Slack 0 (absolute and relative), which is `--affinity off`, changes nothing: the seeds' strict
   order, ties included.
7. Learning. When a box's answer goes to the client, the call's binding moves to that box and its
   chain is recorded for (box, model): a failover moves the binding, and the next turns stick
   to the new box.
8. Memory. Bindings and nodes share one LRU of at most `capacity` entries; a lookup that hits
   and every record refreshes its entries. Nothing here is ever stored, logged or exported:
   the hashes are salted per process by their seed.
9. Several routers share the bindings (not the prefix nodes) under a bound key's identity (the
   text of its scoped parts: `identity_of`), the same in every process (fleetwide/bindings.py
   writes only a digest of it to the shared server): a session bound on one router is found by
   the next router it reaches.
"""

from __future__ import annotations

from operator import indexOf, itemgetter
from typing import Hashable, Mapping, NamedTuple, Sequence

from router.core.types import new_tuple

# Headers that carry a conversation's identity, first present wins: ours, then the ones coding
# harnesses send on every request of a session (Codex CLI: `session_id`, and `conversation_id`
# in its older releases; Claude Code: `x-claude-code-session-id`), then a common generic one.
SESSION_HEADERS = ("x-router-session", "session_id", "conversation_id", "x-claude-code-session-id",
                   "x-session-id")
_SESSION_NAMES = frozenset(SESSION_HEADERS)
# One entry (an OrderedDict slot, its key and a 4-tuple node) holds ~200 bytes (tracemalloc over
# 100k entries: 196-212 B), so `--affinity-memory` MiB converts to entries at this rate.
ENTRY_BYTES = 200

# The first element (a system prompt, a tool preamble) is shared by every conversation of an
# app: a match must reach at least the second element to pull (rule 3a).
MIN_PULL_DEPTH = 2
# A bound key outranks any prefix depth (the chain has at most a few hundred elements).
BOUND_DEPTH = 1 << 30

SESSION, KEY, USER, RESPONSE, PREFIX = "session", "key", "user", "response", "prefix"
BODY_KEY_FIELDS = ("prompt_cache_key", "user", "previous_response_id")
_BODY_KINDS = (KEY, USER, RESPONSE)


class Slack(NamedTuple):
    """How far above the best serving box's load a pulled box may be and still go first (rule 4)."""

    absolute: float
    relative: float

    @property
    def off(self) -> bool:
        return self.absolute <= 0 and self.relative <= 0

    def limit(self, best: int) -> float:
        return best + self.absolute + self.relative * best


OFF = Slack(0.0, 0.0)
# Chosen with bench/affinity.py (docs/affinity.md): with 16 conversations over 4 boxes a box's
# load swings by 2-3 around the mean, so a slack of 2 + 50 % keeps ~all turns home while a box
# twice as loaded as the best one still sheds its new work.
DEFAULT_SLACK = Slack(2.0, 0.5)


class Key(NamedTuple):
    """A call's affinity key: its kind (rule 1) and, for a bound kind, the hash of its scoped
    parts (scope, model, kind, value) and those parts, whose text (`identity_of`) several routers
    share a binding under (rule 9); for a prefix, the chain (the scope is in its seed)."""

    kind: str
    bound: int = 0
    chain: tuple[int, ...] = ()
    scoped: tuple = ()  # several routers share a binding under these parts' text (`identity_of`)


def bound_key(headers: Mapping[str, str], fields: Sequence[object], scope: Hashable,
              model: str) -> Key | None:
    """The call's key when a session header or a body field gives one (rules 1 and 2), first
    present wins; None: the call's key is its prompt's (`prefix_key`), hashed only then (hashing
    is the costly part). `headers`: the call's headers by name; `fields`: the body's
    BODY_KEY_FIELDS values (parsed; a non-string or empty one is absent)."""
    if not _SESSION_NAMES.isdisjoint(headers):  # most calls carry none of them
        for name in SESSION_HEADERS:
            value = headers.get(name)
            if value:
                scoped = (scope, model, SESSION, value)
                # keys are made on every call: new_tuple, without Key's Python-level __new__
                return new_tuple(Key, (SESSION, hash(scoped), (), scoped))
    if any(fields):  # most calls carry none of them
        for kind, value in zip(_BODY_KINDS, fields):
            if isinstance(value, str) and value:
                scoped = (scope, model, kind, value)
                return new_tuple(Key, (kind, hash(scoped), (), scoped))
    return None


def identity_of(scope: Hashable, model: str, kind: str, value: str) -> str:
    """A bound key's identity, the same text in every router process (rule 9): the scope is
    made of strings (and None), whose repr is."""
    return "\x00".join((repr(scope), model, kind, value))


def prefix_key(chain: tuple[int, ...]) -> Key | None:
    """The key of a call that has no bound one: its prompt's prefix chain (seeded with the scope
    and the model), or None for a prompt of fewer than MIN_PULL_DEPTH elements (rule 1)."""
    return new_tuple(Key, (PREFIX, 0, chain, ())) if len(chain) >= MIN_PULL_DEPTH else None


def response_key(scope: Hashable, model: str, response_id: str) -> int:
    """The binding a Responses answer's id leaves, found again by its `previous_response_id`."""
    return hash((scope, model, RESPONSE, response_id))


# Where a key points: (box, depth), depth BOUND_DEPTH for a binding (AffinityIndex.pull).
Pull = tuple[str, int]


class Steer(NamedTuple):
    """What a decision needs to apply affinity: where the key points, whether the call has a key
    at all, the slack, and a random number for the miss's tie (rule 5)."""

    pull: Pull | None
    keyed: bool
    slack: Slack
    spin: int


_BOX_ID = itemgetter(1)  # a ranking entry's box id


def place(ranked: list, pull: Pull | None, keyed: bool, slack: Slack, spin: int) -> tuple[int, bool]:
    """Affinity applied to `ranked` (decide's sorted (rank key, box id, why) entries, rank key =
    (tier, load, pressure, ...), tier 0 = serving; rules 4-6). Returns (index, hit): the entry
    that goes first, the others keeping their order (0: the order stands), and hit when it is the
    pulled box. An index, not a new list: the caller moves the entry in its own list."""
    absolute, relative = slack
    if (absolute <= 0.0 and relative <= 0.0) or not ranked:  # 0.0: a float compare the interpreter specializes
        return 0, False
    first = ranked[0][0]
    if first[0] != 0:
        return 0, False
    if pull is not None:
        try:
            index = indexOf(map(_BOX_ID, ranked), pull[0])
        except ValueError:  # the pulled box is ruled out this time
            index = -1
        # sorted by (tier, load): if the pulled box serves within the slack, so does every box
        # before it
        rank = ranked[index][0]
        if index >= 0 and rank[0] == 0 and rank[1] <= first[1] + absolute + relative * first[1]:
            return index, True
    if not keyed:
        return 0, False
    tied = 1
    best = first[1:3]
    while tied < len(ranked) and ranked[tied][0][0] == 0 and ranked[tied][0][1:3] == best:
        tied += 1
    return spin % tied, False
