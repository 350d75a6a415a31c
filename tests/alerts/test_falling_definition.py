"""One definition of "falling" (telemetry/procfs/headroom.py, FallingRule): the rule file writes the same numbers,
and the Python evidence agrees with PromQL's deriv() on the reported collapse."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from telemetry.catalogue.metrics import HUGE_PAGE_FAULT_SUCCESS_RATIO, UNIFIED_HEADROOM_WITHOUT_RECLAIM
from telemetry.procfs.headroom import FALLING, falling_evidence, headroom_taken, least_squares_slope, unified_headroom

RULES = Path(__file__).resolve().parents[2] / "dashboards" / "prometheus" / "memtel-alerts.yml"  # the package's file
GIB = 1 << 30


def recorded(name: str) -> str:
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            if rule.get("record") == name:
                return str(rule["expr"])
    raise AssertionError(f"no recording rule {name}")


def test_the_rule_file_writes_the_numbers_of_the_code():
    assert eval(recorded("memtel:unified_headroom_falling_floor_ratio").removeprefix("vector")) == FALLING.floor_ratio
    assert eval(recorded("memtel:unified_headroom_falling_rate_bytes_per_second").removeprefix("vector")) == \
        FALLING.rate_bytes_per_second
    assert eval(recorded("memtel:unified_headroom_falling_min_drop_bytes").removeprefix("vector")) == \
        FALLING.min_drop_bytes
    window = f"[{FALLING.window_seconds:g}s]"
    deriv = recorded("instance:memtel_node_unified_headroom_bytes:deriv8s")
    assert window in deriv and f">= {FALLING.min_samples}" in deriv
    assert window in recorded("instance:memtel_node_unified_headroom_bytes:drop8s")
    alert = next(r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
                 if r.get("alert") == "MemtelUnifiedHeadroomFalling")
    for name in ("floor_ratio", "rate_bytes_per_second", "min_drop_bytes"):
        assert f"memtel:unified_headroom_falling_{name}" in alert["expr"]
    assert re.search(r"deriv8s\s*<", alert["expr"]) and re.search(r"drop8s\s*>=", alert["expr"])
    # The engine starts' part (issue 29): Low's floor, the hook's lag, the window an ended start still counts.
    assert eval(recorded("memtel:unified_headroom_low_threshold_bytes").removeprefix("vector")) == \
        FALLING.low_floor_bytes
    assert f"[{FALLING.start_lag_seconds:g}s]" in \
        recorded("node_engine:memtel_node_unified_headroom_after_start_bytes:max5s")
    assert f"last_over_time(memtel_engine_start_remaining_bytes{window})" in \
        recorded("node_engine:memtel_engine_start_remaining_bytes")
    assert re.search(r"unless on \(node\) node:memtel_unified_headroom_explained_by_starts == 1\s*$", alert["expr"])
    # What a start takes, measured as the headroom is (issue 38): from the daemon's own series.
    assert "node_engine:memtel_engine_start_headroom_taken_bytes" in \
        recorded("node_engine:memtel_node_unified_headroom_after_start_bytes")
    assert UNIFIED_HEADROOM_WITHOUT_RECLAIM.series in \
        recorded("node:memtel_node_unified_headroom_without_reclaim_bytes:min")
    assert HUGE_PAGE_FAULT_SUCCESS_RATIO.series in recorded("node:memtel_node_huge_page_fault_fallback_ratio")
    taken = recorded("node_engine:memtel_engine_start_headroom_taken_bytes")
    assert "node:memtel_node_huge_page_fault_fallback_ratio" in taken
    assert "node:memtel_node_unified_headroom_without_reclaim_bytes:min" in taken
    explained = recorded("node:memtel_unified_headroom_explained_by_starts")
    assert re.search(r"node:memtel_node_unified_headroom_after_starts_bytes\s+>= bool on \(\) group_left \(\) "
                     r"memtel:unified_headroom_low_threshold_bytes", explained)


def collapse(second: int) -> float:
    """The reported collapse at 1 s samples: 29 GiB until t=0, then 2.944 GiB/s down to 2.5 GiB."""
    return max(29 * GIB - 26.5 * GIB / 9 * max(second, 0), 2.5 * GIB)


def test_the_collapse_is_falling_two_seconds_in_and_not_one():
    def evidence(at: int):
        return falling_evidence([(float(t), collapse(t)) for t in range(at - 20, at + 1)], 120 * GIB)

    assert not evidence(1).is_falling()  # 2.9 GiB lost: under the 4 GiB minimum drop
    two = evidence(2)
    assert two.is_falling()
    # PromQL's deriv over [8s] at t=2 s (headroom_test.yml checks the drop there: 6323146297 bytes)
    assert round(two.drop_bytes) == 6323146297
    assert two.slope_bytes_per_second == least_squares_slope([(float(t), collapse(t)) for t in range(-6, 3)])


def test_a_fall_that_stops_above_a_quarter_of_memory_or_a_wobble_is_not_falling():
    flat_alloc = [(float(t), 100 * GIB - 6 * GIB * min(max(t, 0), 10)) for t in range(-10, 12)]
    assert not falling_evidence(flat_alloc, 120 * GIB).is_falling()  # 40 GiB left of 120: above the floor
    wobble = [(float(t), (5 + 1.5 * (-1) ** t) * GIB) for t in range(20)]
    assert not falling_evidence(wobble, 24 * GIB).is_falling()  # below a quarter of 24 GiB, but no 4 GiB fall
    too_few = [(float(t), collapse(t)) for t in range(0, 5)]
    assert falling_evidence(too_few, 120 * GIB).samples < FALLING.min_samples
    assert not falling_evidence(too_few, 120 * GIB).is_falling()


# -- engine starts (issue 29): the Python definition on the shapes of headroom_test.yml's start tests ------------
def start_fall(t: int) -> float:
    """100 GiB of headroom, then 8 GiB/s after t=30 down to 20 GiB at t=40 (an engine's KV cache)."""
    return 100 * GIB - 8 * GIB * min(max(t - 30, 0), 10)


def first_falling(headroom, remaining, seconds: int = 140) -> int | None:
    """The first second the definition holds, fed second by second as the protect action is."""
    from telemetry.daemon.protect import Episodes

    episodes = Episodes()
    for t in range(seconds):
        value = remaining(t)
        if episodes.observe(float(t), headroom(t), 120 * GIB, {} if value is None else {"e": value}) is not None:
            return t
    return None


def hook_every_5s(plan: float, until: int | None, end: int | None = None):
    """What the start will still take as the memtel-hook job reads it every 5 s: the plan less what the engine
    took by the last read (the engine takes the fall of start_fall), absent from `end` on."""
    def remaining(t: int) -> float | None:
        if end is not None and t >= end:
            return None
        read = t - t % 5
        return max(plan - (start_fall(0) - start_fall(min(read, until if until is not None else read))), 0.0)
    return remaining


def test_a_start_the_hook_announces_is_not_falling_and_the_same_fall_without_it_is():
    assert first_falling(start_fall, lambda t: None) == 39  # headroom_test.yml: fires at 39 s without a hook
    assert first_falling(start_fall, hook_every_5s(80 * GIB, None, end=45)) is None


def test_a_start_that_asks_for_more_than_the_node_has_is_falling():
    def headroom(t: int) -> float:
        return 2.5 * GIB if t > 42 else 100 * GIB - 8 * GIB * min(max(t - 30, 0), 12)

    assert first_falling(headroom, hook_every_5s(120 * GIB, None)) == 39


def test_a_collapse_during_a_start_is_falling_once_the_hook_lag_has_passed():
    def headroom(t: int) -> float:
        if t <= 61:
            return start_fall(t)
        return max(20 * GIB - 3 * GIB * (t - 61), 2 * GIB)

    assert first_falling(headroom, hook_every_5s(80 * GIB, None)) == 72  # headroom_test.yml: 72 s


# -- the huge-page discount on both sides (issue 38) ------------------------------------------------------------
def test_what_a_start_takes_is_the_headroom_less_the_headroom_after_it():
    """headroom_taken is the headroom's own definition applied before and after a start takes its bytes."""
    for available, contiguous in ((120 * GIB, 0), (117 * GIB, 49 * GIB), (60 * GIB, 60 * GIB)):
        for ratio in (None, 0.0, 0.5, 0.88, 1.0):
            for remaining in (0, 1 * GIB, 30 * GIB, 49 * GIB, 55 * GIB, available):
                before = unified_headroom(available, contiguous, ratio)
                after = unified_headroom(available - remaining, max(contiguous - remaining, 0), ratio)
                assert abs(headroom_taken(remaining, contiguous, ratio) - (before - after)) <= 1


def test_the_numbers_of_the_rule_files_unit_tests():
    """headroom_test.yml's cases of node_engine:memtel_engine_start_headroom_taken_bytes, in Python."""
    assert headroom_taken(30 * GIB, 40 * GIB, 0.75) == 30 * GIB    # within the free 2 MiB blocks: byte for byte
    assert headroom_taken(50 * GIB, 10 * GIB, None) == 50 * GIB    # no evidence of the ratio: byte for byte
    assert headroom_taken(50 * GIB, 10 * GIB, 0.75) == 40 * GIB    # 10 + 0.75 x 40
    assert headroom_taken(64 * GIB, 0, 0.75) == 48 * GIB


def page_cache_start(t: int) -> tuple[float, float]:
    """headroom_test.yml's start out of the page cache: (headroom, what the start will still take) at 1 s reads,
    no free 2 MiB blocks, a success ratio of 0.75: 90 GiB of headroom, 112 GiB to take at 16 GiB/s from t=30."""
    k = min(max(t - 30, 0), 7)
    return 90 * GIB - 12 * GIB * k, 112 * GIB - 16 * GIB * k


def test_a_start_out_of_the_page_cache_is_explained_on_the_headrooms_measure_and_not_byte_for_byte():
    from telemetry.daemon.protect import Episodes

    def first(discount: bool) -> int | None:
        episodes = Episodes()
        for t in range(100):
            headroom, remaining = page_cache_start(t)
            extra = (0.0, 0.75) if discount else ()
            if episodes.observe(float(t), headroom, 128 * GIB, {"e": remaining}, *extra) is not None:
                return t
        return None

    assert first(discount=True) is None
    assert first(discount=False) == 35  # where the rule before issue 38 paged (headroom_test.yml)
