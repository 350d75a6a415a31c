"""One definition of "falling" (telemetry/procfs/headroom.py, FallingRule): the rule file writes the same numbers,
and the Python evidence agrees with PromQL's deriv() on the reported collapse."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from telemetry.procfs.headroom import FALLING, falling_evidence, least_squares_slope

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
