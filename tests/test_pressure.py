"""GPU pressure (router/core/pressure.py): its numbered rules, the thresholds table, the
smoothing's half-life, and properties over any reading."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.core.pressure import (
    HALF_LIFE_S,
    NEUTRAL_PRESSURE,
    SOURCE_BOX,
    SOURCE_SCAN,
    STALE_AFTER_S,
    Reading,
    Smoothed,
    pick_reading,
    pressure,
    smooth,
    usable,
    valid_util,
)


def reading(util, at=0.0, source=SOURCE_SCAN, free=None, total=None) -> Reading:
    return Reading(util, free, total, at, source)


any_util = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-1000, max_value=1000),
)
valid_utils = st.floats(min_value=0.0, max_value=100.0)
times = st.floats(min_value=0.0, max_value=1e6)


# -- thresholds ---------------------------------------------------------------------------------

LEVEL_TABLE = [
    (0.0, 0),
    (24.999, 0),
    (25.0, 1),
    (59.999, 1),
    (60.0, 2),
    (84.999, 2),
    (85.0, 3),
    (100.0, 3),
    (100, 3),  # an int percentage is valid
]


@pytest.mark.parametrize(("util", "expected"), LEVEL_TABLE)
def test_thresholds_table(util, expected):
    fresh = reading(util, at=5.0)
    assert pressure(smooth(None, fresh), fresh, now=5.0) == expected


# -- rule 2: freshness, with the boundary at exactly 10 s --------------------------------------


def test_exactly_ten_seconds_old_is_fresh_and_a_hair_more_is_stale():
    busy = reading(95.0, at=100.0)
    state = smooth(None, busy)
    assert pressure(state, busy, now=100.0 + STALE_AFTER_S) == 3
    assert pressure(state, busy, now=math.nextafter(100.0 + STALE_AFTER_S, math.inf)) == NEUTRAL_PRESSURE
    assert pressure(state, busy, now=100.0 + 10.001) == NEUTRAL_PRESSURE


def test_nan_stamp_is_stale():
    assert not usable(reading(50.0, at=math.nan), now=0.0)


# -- rule 3 and 6: anything missing, invalid or stale is neutral -------------------------------


@pytest.mark.parametrize("util", [None, math.nan, math.inf, -math.inf, -0.1, 100.1, True, "50"])
def test_invalid_utilisation_is_neutral(util):
    bad = reading(util, at=1.0)
    assert not valid_util(util)
    assert pressure(None, bad, now=1.0) == NEUTRAL_PRESSURE
    # even with an average of a busy past: no fresh valid reading, no opinion
    assert pressure(Smoothed(99.0, 0.5), bad, now=1.0) == NEUTRAL_PRESSURE


def test_missing_reading_is_neutral():
    assert pressure(None, None, now=0.0) == NEUTRAL_PRESSURE
    assert pressure(Smoothed(99.0, 0.0), None, now=0.0) == NEUTRAL_PRESSURE


@given(any_util, times, times, st.one_of(st.none(), valid_utils))
def test_pressure_is_always_0_to_3(util, at, now, prev_value):
    prev = None if prev_value is None else Smoothed(prev_value, at - 1.0)
    r = reading(util, at=at)
    assert pressure(smooth(prev, r), r, now) in (0, 1, 2, 3)


@given(any_util, times, st.floats(min_value=0.0, max_value=1e6, exclude_min=True))
def test_stale_is_neutral(util, at, extra_s):
    r = reading(util, at=at)
    now = at + STALE_AFTER_S + extra_s
    if now - at > STALE_AFTER_S:  # float rounding may swallow a tiny extra_s
        assert pressure(smooth(None, r), r, now) == NEUTRAL_PRESSURE


@given(any_util, times)
def test_invalid_is_neutral(util, at):
    r = reading(util, at=at)
    if not valid_util(util):
        assert pressure(smooth(None, r), r, at) == NEUTRAL_PRESSURE


# -- rule 5: smoothing ---------------------------------------------------------------------------


def test_first_reading_starts_the_average():
    assert smooth(None, reading(40.0, at=3.0)) == Smoothed(40.0, 3.0)


def test_half_life_closes_half_the_gap():
    state = smooth(Smoothed(0.0, 0.0), reading(100.0, at=HALF_LIFE_S))
    assert state.value == pytest.approx(50.0)
    state = smooth(state, reading(100.0, at=2 * HALF_LIFE_S))
    assert state.value == pytest.approx(75.0)


def test_half_life_does_not_depend_on_the_sampling_rate():
    coarse = smooth(Smoothed(0.0, 0.0), reading(100.0, at=HALF_LIFE_S))
    fine = Smoothed(0.0, 0.0)
    for i in range(1, 31):
        fine = smooth(fine, reading(100.0, at=HALF_LIFE_S * i / 30))
    assert fine.value == pytest.approx(coarse.value)


@given(valid_utils, valid_utils, st.floats(min_value=0.01, max_value=5.0))
def test_smoothing_converges_toward_a_constant_input(start, target, step_s):
    state = Smoothed(start, 0.0)
    gap = abs(start - target)
    t = 0.0
    while t < 20 * HALF_LIFE_S:
        t += step_s
        state = smooth(state, reading(target, at=t))
        new_gap = abs(state.value - target)
        assert new_gap <= gap + 1e-9  # never moves away
        assert min(start, target) - 1e-9 <= state.value <= max(start, target) + 1e-9
        gap = new_gap
    assert gap <= abs(start - target) * 2 ** -19 + 1e-9


def test_a_reading_not_newer_than_the_state_or_invalid_leaves_it():
    state = Smoothed(30.0, 10.0)
    assert smooth(state, reading(90.0, at=10.0)) is state  # the same reading folded twice
    assert smooth(state, reading(90.0, at=9.0)) is state  # an older one
    assert smooth(state, reading(math.nan, at=11.0)) is state
    assert smooth(None, reading(None, at=11.0)) is None


def test_pressure_follows_the_average_not_the_last_reading():
    state = Smoothed(10.0, 0.0)
    spike = reading(100.0, at=0.5)  # one burst in an idle stretch
    state = smooth(state, spike)
    assert pressure(state, spike, now=0.5) == 0


# -- rule 4: which source ----------------------------------------------------------------------


def test_scan_beats_box_while_fresh():
    scan = reading(90.0, at=0.0, source=SOURCE_SCAN)
    box = reading(10.0, at=9.0, source=SOURCE_BOX)
    assert pick_reading(scan, box, now=STALE_AFTER_S) is scan  # exactly 10 s: still the scan


def test_box_is_used_when_scan_is_stale_or_missing_or_invalid():
    box = reading(10.0, at=9.0, source=SOURCE_BOX)
    assert pick_reading(reading(90.0, at=0.0), box, now=10.5) is box
    assert pick_reading(None, box, now=10.5) is box
    assert pick_reading(reading(None, at=10.0), box, now=10.5) is box


def test_nothing_usable_picks_nothing():
    assert pick_reading(reading(90.0, at=0.0), reading(10.0, at=0.0, source=SOURCE_BOX), now=11.0) is None
    assert pick_reading(None, None, now=0.0) is None


@given(
    st.one_of(st.none(), st.builds(reading, any_util, times)),
    st.one_of(st.none(), st.builds(reading, any_util, times, st.just(SOURCE_BOX))),
    times,
)
def test_pick_reading_matches_its_rule(scan, box, now):
    picked = pick_reading(scan, box, now)
    if usable(scan, now):
        assert picked is scan
    elif usable(box, now):
        assert picked is box
    else:
        assert picked is None


# -- rule 7: memory never moves pressure ---------------------------------------------------------


@given(valid_utils, st.one_of(st.none(), st.integers(0, 1 << 40)), st.one_of(st.none(), st.integers(0, 1 << 40)))
def test_memory_never_moves_pressure(util, free, total):
    plain = reading(util, at=1.0)
    with_memory = reading(util, at=1.0, free=free, total=total)
    assert pressure(smooth(None, with_memory), with_memory, 1.0) == pressure(smooth(None, plain), plain, 1.0)
