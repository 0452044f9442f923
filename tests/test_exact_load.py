"""A box's load is exact at every instant (router/boxes/state.py rule 4): a call that ended no
longer counts, whatever snapshot came in between, so calls that follow each other follow the
ranking exactly; calls still running spread."""

from __future__ import annotations

from router._fastpath import Reservations
from router.boxes.config import BoxConfig
from router.boxes.state import BoxState, Inventory
from router.core.decide import decide
from router.core.types import BoxKind, Call
from router.serve.load import Load

GIB = 1 << 30
CALL = Call(model="m", kinds=frozenset({BoxKind.HUGPY}))


class Rig:
    """Boxes, the reservation table and the scheduler's steps; each call's load is the serve
    layer's own `Load` (router/serve/load.py), to which the rig is the scheduler (its generation,
    its poke) and the wait queue (the slot a call leaves)."""

    def __init__(self, free_gib: list[int]) -> None:
        self.reservations = Reservations()
        self.generation = 0
        self.pokes = 0
        self.offered: list[str] = []  # boxes whose slot a call left
        self.boxes = []
        for i, free in enumerate(free_gib):
            box = BoxState(BoxConfig(name=f"b{i}", url=f"http://127.0.0.1:{9000 + i}"), i, i)
            box.online = True
            box.set_inventory(Inventory(catalog={"m": "m"}, free_gpu_bytes=free * GIB))
            self.boxes.append(box)

    def pick(self) -> BoxState:
        decision = decide(CALL, [b.facts(self.reservations.count(b.index)) for b in self.boxes])
        return next(b for b in self.boxes if b.name == decision.boxes[0])

    def poke(self) -> None:
        self.pokes += 1

    def freed(self, box: BoxState) -> None:
        self.offered.append(box.name)

    def start(self) -> tuple[BoxState, Load]:
        box = self.pick()
        load = Load(self.reservations, self, self)  # type: ignore[arg-type]
        load.reserve(box)
        return box, load

    def end(self, box: BoxState, load: Load) -> None:
        load.release()
        assert load.box is None and load.token == 0
        assert self.offered[-1] == box.name  # the slot it left is offered to the queue

    def snapshot(self) -> None:
        """What the scheduler publishes: pending is the router's calls on each box now."""
        self.generation += 1
        self.reservations.supersede(self.generation)
        for box in self.boxes:
            box.set_load(box.in_flight, 1)


def test_sequential_calls_follow_the_ranking_exactly_across_snapshots():
    rig = Rig([8, 6, 4])
    for _ in range(4):
        box, load = rig.start()
        assert box.name == "b0"  # the most free GPU memory, every time
        rig.snapshot()  # published while the call runs: it counts the call as pending
        rig.end(box, load)  # its release is for a superseded generation
        assert box.in_flight == 0


def test_a_burst_still_spreads():
    rig = Rig([8, 6, 4])
    picked = [rig.start()[0].name for _ in range(3)]
    assert picked == ["b0", "b1", "b2"]
    rig.snapshot()  # the three calls are now pending, not reserved
    assert rig.start()[0].name == "b0"  # all carry one: the tie-break again


def test_the_boxs_own_busy_seats_count_when_more():
    rig = Rig([8, 6])
    from router.core.types import Resident

    rig.boxes[0].set_inventory(Inventory(catalog={"m": "m"}, free_gpu_bytes=8 * GIB,
                                         residents={"x": Resident("x", busy=True), "y": Resident("y", busy=True)}))
    assert rig.boxes[0].facts(0).pending == 2  # other clients' work the router did not send
    assert rig.pick().name == "b1"


def test_each_field_of_a_boxs_facts_holds_the_state_it_names():
    """BoxState builds its facts by position (a keyword build costs a dict per call): a field out
    of place would show here."""
    from router.core.pairs import Fit, PairView
    from router.core.types import Resident

    config = BoxConfig(name="b", url="http://127.0.0.1:9", kind=BoxKind.OPENAI, pool="p", blocked=True,
                       max_inflight=40)
    box = BoxState(config, 0, 6)
    residents = {"m": Resident("m", busy=True)}
    pairs = PairView(blanket_blocked=True)
    box.online, box.down, box.catalog = True, "why", frozenset({"m", "n"})
    box.inventory = Inventory(residents=residents, free_gpu_bytes=3 * GIB, pairs=pairs)
    box.contracts = {"m": "s", "n": None}
    box.last_picked_s, box.in_flight, box.others, box.pressure = 12.5, 7, 2, 4
    box.refusals, box.cooling = {"n": 3}, {"n": (99.0, 5)}
    box.fits = {"n": Fit.RAM}
    facts = box.facts(reservations=1)._asdict()
    assert facts == {
        "id": "b", "kind": BoxKind.OPENAI, "order": 6, "online": True, "pool": "p", "blocked": True,
        "catalog": frozenset({"m", "n"}), "residents": residents, "contracts": {"m": "s"},
        "free_gpu_bytes": 3 * GIB, "pending": 8, "pressure": 4, "reservations": 1, "last_picked_s": 12.5,
        "in_flight": 9, "max_inflight": 40, "cooling": {"n": 5}, "recent_refusals": 3, "down": "why",
        "pairs": pairs, "fits": {"n": Fit.RAM},
    }


def test_a_taken_call_rebuilds_the_facts_and_a_change_their_derived_parts():
    """state.py invariant 1: a call taken on the same settings moves `last_picked_s` alone (the
    facts' derived parts are kept), a new load contract or a refusal is in the next facts."""
    from router.core.refusal import RefusalCode
    from router.core.types import Resident

    box = BoxState(BoxConfig(name="h", url="http://127.0.0.1:9", kind=BoxKind.HUGPY), 0, 0)
    box.online = True
    box.set_inventory(Inventory(catalog={"m": "m"}, residents={"m": Resident("m")}))
    box.took(CALL, 1.0)
    first = box.facts(0)
    assert (first.last_picked_s, first.contracts, first.cooling) == (1.0, {}, {})
    box.took(CALL, 2.0)  # the same contract: only the pick moved
    again = box.facts(0)
    assert again is not first and again.last_picked_s == 2.0 and again.contracts is first.contracts
    box.took(Call(model="m", kinds=CALL.kinds, knobs='{"temperature":0.5}'), 3.0)  # another contract
    loaded = box.facts(0)
    assert loaded.last_picked_s == 3.0 and loaded.contracts == {"m": box.loaded["m"]} != {}
    box.in_flight = 2
    box.refused(CALL, RefusalCode.INSUFFICIENT_RESOURCES, 4.0)
    cooled = box.facts(0)
    assert cooled.cooling == {"m": 1} and cooled.recent_refusals == 1 and cooled.in_flight == 2
