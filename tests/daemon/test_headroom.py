"""telemetry/procfs/headroom.py at its edges: the cases mutation testing found unchecked (docs/testing.md,
"Mutation testing"). Pure functions on hand-made numbers; each expected figure is worked out in a comment."""

from __future__ import annotations

import pytest

from telemetry.procfs.headroom import (
    FALLING,
    FallingEvidence,
    FaultWindow,
    falling_evidence,
    least_squares_slope,
    selected,
    thp_faults_compact,
)

GIB = 1024**3


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def counters(alloc: int, fallback: int) -> dict[str, int]:
    return {"thp_fault_alloc": alloc, "thp_fault_fallback": fallback}


def test_a_sysfs_file_without_brackets_is_read_whole():
    assert selected("never") == "never"
    assert selected(" madvise \n") == "madvise"
    assert selected("always [madvise] never\n") == "madvise"


@pytest.mark.parametrize("defrag", ["always", "madvise", "defer+madvise"])
def test_with_thp_madvise_each_compacting_defrag_counts(defrag):
    assert thp_faults_compact("madvise", defrag)


@pytest.mark.parametrize("defrag", ["defer", "never"])
def test_with_thp_madvise_a_defrag_that_never_compacts_does_not_count(defrag):
    assert not thp_faults_compact("madvise", defrag)


def test_the_fault_window_reports_its_counts_and_its_length():
    clock = Clock()
    window = FaultWindow(window_seconds=10.0, clock=clock)
    clock.now = 100.0
    window.add(counters(50, 7))
    clock.now = 104.0
    outcomes = window.add(counters(80, 10))
    assert (outcomes.alloc, outcomes.fallback, outcomes.seconds) == (30, 3, 4.0)


def test_a_sample_exactly_at_the_windows_start_begins_the_window():
    clock = Clock()
    window = FaultWindow(window_seconds=10.0, clock=clock)
    for now, alloc in ((0.0, 0), (10.0, 5), (20.0, 9)):
        clock.now = now
        outcomes = window.add(counters(alloc, 0))
    # The sample at 10 s is at the start of the window 10..20 s: it is kept, the one at 0 s goes.
    assert (outcomes.alloc, outcomes.seconds) == (4, 10.0)


def test_either_counter_going_backwards_restarts_the_window():
    clock = Clock()
    window = FaultWindow(window_seconds=100.0, clock=clock)
    window.add(counters(10, 10))
    clock.now = 5.0
    outcomes = window.add(counters(20, 3))  # the fallback counter went back: a replaced fixture
    assert (outcomes.alloc, outcomes.fallback, outcomes.seconds) == (0, 0, 0.0)


def evidence(**changes) -> FallingEvidence:
    """Evidence that is falling by every clause with a margin; `changes` moves one clause to its edge."""
    fields = {"headroom_bytes": 10 * GIB, "mem_total_bytes": 120 * GIB, "slope_bytes_per_second": -2.0 * GIB,
              "drop_bytes": 8 * GIB, "samples": 9}
    fields.update(changes)
    return FallingEvidence(**fields)


def test_each_clause_of_falling_at_its_edge():
    assert evidence().is_falling()
    assert evidence(samples=FALLING.min_samples).is_falling()  # "at least min_samples"
    assert evidence(drop_bytes=FALLING.min_drop_bytes).is_falling()  # "at least min_drop_bytes"
    assert not evidence(headroom_bytes=FALLING.floor_ratio * 120 * GIB).is_falling()  # "below" the floor
    assert not evidence(slope_bytes_per_second=-FALLING.rate_bytes_per_second).is_falling()  # "steeper than"
    assert not evidence(slope_bytes_per_second=0.0).is_falling()  # a flat line is not a fall
    assert not evidence(after_starts_bytes=FALLING.low_floor_bytes).is_falling()  # explained "at least" the floor
    assert evidence(after_starts_bytes=FALLING.low_floor_bytes - 1).is_falling()


def test_the_slope_of_two_points_and_of_three():
    assert least_squares_slope([(0.0, 0.0), (1.0, 2.0)]) == 2.0
    assert least_squares_slope([(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]) == 2.0  # spread 2: divided by it
    # Two readings at each of two times: spread (0.25 × 4) exactly 1, slope 3.
    assert least_squares_slope([(0.0, 1.0), (0.0, 1.0), (1.0, 4.0), (1.0, 4.0)]) == 3.0
    assert least_squares_slope([(5.0, 1.0), (5.0, 2.0)]) is None  # no spread in time: no slope


def test_the_slope_keeps_its_precision_at_clock_and_byte_scales():
    # A clock in the billions of seconds and headrooms of ~100 GiB falling 1 GiB/s with a wobble (a third of a
    # GiB lower at odd seconds, which adds no slope: the odd seconds' mean time is the mean time). Centring the
    # times keeps the products small, so the fit is exact; with uncentred times it is off by ~1,700 bytes/s.
    points = [(1.7e9 + t, 100.0 * GIB - t * GIB - (t % 2) * GIB / 3) for t in range(7)]
    assert least_squares_slope(points) == pytest.approx(-GIB, abs=1.0)


# -- where the node ends once its starting engines are done (_after_starts) -----------------------------------
# The rule: window 8 s, start lag 5 s. Samples one a second at t = 0..10; the newest, t = 10, reads 10 GiB.
TIMES = [float(t) for t in range(11)]


def after_starts(values, remaining):
    return falling_evidence(list(zip(TIMES, values, strict=True)), 120 * GIB,
                            start_remaining=remaining).after_starts_bytes


def test_a_start_that_ended_within_the_lag_counts_as_taking_nothing_more():
    values = [float(30 - 2 * t) * GIB for t in range(11)]  # 30 GiB falling 2 GiB a second to 10 GiB
    remaining = [{"a": 8.0 * GIB}] * 8 + [{}] * 3  # the start of a ends after t = 7
    # Over t = 5..10: t = 5..7 give 20-8, 18-8, 16-8 GiB; t = 8..10 (ended, recent) give 14, 12, 10 GiB: 14 GiB.
    assert after_starts(values, remaining) == 14.0 * GIB


def test_a_sample_before_the_start_began_is_not_counted():
    values = [float(30 - 2 * t) * GIB for t in range(11)]
    remaining = [{}] * 6 + [{"a": 1.0 * GIB}] * 5  # a starts at t = 6
    # t = 5 has no start of a before it: left out (it would give 20 GiB). t = 6..10: 18-1 ... 10-1: 17 GiB.
    assert after_starts(values, remaining) == 17.0 * GIB


def test_a_start_is_recent_for_one_window_after_its_last_sample():
    values = [float(10 + t) * GIB for t in range(11)]  # rising: the newest recent sample gives the most
    remaining = [{"a": 1.0 * GIB}] + [{}] * 10  # a was starting only at t = 0
    # For t = 5..8 that is within the 8 s window (0 >= t - 8, t = 8 on its edge); not for t = 9, 10: 18 GiB.
    assert after_starts(values, remaining) == 18.0 * GIB
    long_ago = list(zip([-10.0, *TIMES[1:]], values, strict=True))  # the same start, 15 s before t = 5
    assert falling_evidence(long_ago, 120 * GIB, start_remaining=remaining).after_starts_bytes is None


def test_two_starting_engines_end_at_their_sum_less_one_headroom():
    values = [20.0 * GIB] * 11
    remaining = [{"a": 3.0 * GIB, "b": 5.0 * GIB}] * 11
    # a ends at 20 - 3 = 17, b at 20 - 5 = 15: the node at 17 + 15 - 20 = 12 GiB (each took its own part).
    assert after_starts(values, remaining) == 12.0 * GIB
