"""Gates: the limits a ladder's `gates:` section sets, parsed and validated with the rest of the ladder.

    gates:
      - {max_nv_err_events: 0, min_mem_available_mib: 4096}       # every arm, every step
      - {arm: fixed, max_reserved_growth_mib: 1024}               # one arm
      - {arm: fixed, step: cold-1m, min_headroom_mib: 2048}       # one arm, one step
      - {arm: fixed, baseline: stock, max_ttft_regression_pct: 10}

Each item holds one or more gates and an optional scope (`arm`, `step`; `baseline` for the TTFT
regression). A single mapping is one item. What each gate checks, per request in its scope, is in
`GATES` (and docs/harness.md, "Gates"); the report evaluates them (harness/ab/report/verdict.py) at the
end of `memtel ab run` and in `memtel ab report`, and a failed gate makes both exit with 3.

This module is pure (no network, no report): the ladder's parser calls `parse_gates`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from telemetry.catalogue.metrics import UNIFIED_HEADROOM
from telemetry.errors import ConfigError

# name -> what it checks (the report's wording); the unit is in the name.
GATES: dict[str, str] = {
    "max_reserved_growth_mib": "reserved growth during any one request, on any rank, at most this many MiB",
    "min_headroom_mib": f"the lowest unified-memory headroom ({UNIFIED_HEADROOM.series}) during any request, on any "
                        "node, at least this many MiB",
    "min_mem_available_mib": "the lowest MemAvailable during any request, on any node, at least this many MiB",
    "max_nv_err_events": "NV_ERR_NO_MEMORY kernel-log lines during any one request, on any node, at most this many",
    "max_ttft_regression_pct": "mean client TTFT over the repeats of a step at most this many percent above the "
                               "baseline arm's (needs `baseline`)",
}
SCOPE_KEYS = ("arm", "step", "baseline")
TTFT_REGRESSION = "max_ttft_regression_pct"


@dataclass(frozen=True)
class Gate:
    """One limit and where it applies (None: every arm / every step)."""

    name: str
    limit: float
    arm: str | None = None
    step: str | None = None
    baseline: str | None = None  # max_ttft_regression_pct: the arm it is compared with

    def to_dict(self) -> dict[str, Any]:
        """The ladder file's form of this gate (one item), so a recorded ladder reads back the same."""
        scope = {key: getattr(self, key) for key in SCOPE_KEYS if getattr(self, key) is not None}
        return {self.name: self.limit, **scope}

    def describe(self) -> str:
        limit = f"{self.limit:g}"
        scope = []
        if self.arm:
            scope.append(f"arm {self.arm}")
        if self.baseline:
            scope.append(f"against {self.baseline}")
        if self.step:
            scope.append(f"step {self.step}")
        return f"{self.name} {limit}" + (f" ({', '.join(scope)})" if scope else "")


def parse_gates(data: Any, path: str, fail: Callable[[str, str], ConfigError], arms: Sequence[str],
                steps: Sequence[str]) -> tuple[Gate, ...]:
    """The gates of a ladder's `gates:` value; `fail(path, message)` makes the error naming the field."""
    if data is None:
        return ()
    items = [data] if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise fail(path, f"expected a list of gate items (mappings such as {{max_nv_err_events: 0}}), "
                         f"got {type(data).__name__}")
    gates: list[Gate] = []
    for i, item in enumerate(items):
        where = f"{path}[{i}]" if isinstance(data, list) else path
        if not isinstance(item, dict):
            raise fail(where, f"expected a mapping of gate names to limits, got {type(item).__name__}")
        names = []
        for key in item:
            if key in SCOPE_KEYS:
                continue
            if key not in GATES:
                raise fail(f"{where}.{key}", f"unknown gate {key!r}; valid gates: {', '.join(GATES)} "
                                             f"(scope keys: {', '.join(SCOPE_KEYS)})")
            names.append(str(key))
        if not names:
            raise fail(where, f"no gate in this item; valid gates: {', '.join(GATES)}")
        arm = _member(item.get("arm"), f"{where}.arm", "arm", arms, fail)
        step = _member(item.get("step"), f"{where}.step", "step", steps, fail)
        baseline = _member(item.get("baseline"), f"{where}.baseline", "arm", arms, fail)
        if baseline is not None and TTFT_REGRESSION not in names:
            raise fail(f"{where}.baseline", f"`baseline` is only for {TTFT_REGRESSION}")
        if TTFT_REGRESSION in names:
            if baseline is None:
                raise fail(f"{where}.{TTFT_REGRESSION}", "needs `baseline`: the arm whose TTFT it is compared with")
            if baseline == arm:
                raise fail(f"{where}.baseline", f"{baseline!r} is also the gate's arm; compare two different arms")
        for name in names:
            limit = _limit(item[name], f"{where}.{name}", name, fail)
            gates.append(Gate(name, limit, arm, step, baseline if name == TTFT_REGRESSION else None))
    return tuple(gates)


def _member(value: Any, path: str, what: str, valid: Sequence[str], fail: Callable[[str, str], ConfigError]
            ) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value not in valid:
        raise fail(path, f"{value!r} is not a{'n' if what == 'arm' else ''} {what} of this ladder; "
                         f"valid: {', '.join(valid)}")
    return value


def _limit(value: Any, path: str, name: str, fail: Callable[[str, str], ConfigError]) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise fail(path, f"expected a finite number, got {value!r}")
    if name != TTFT_REGRESSION and value < 0:
        raise fail(path, f"expected a number >= 0, got {value!r}")
    return float(value)


__all__ = ["GATES", "SCOPE_KEYS", "TTFT_REGRESSION", "Gate", "parse_gates"]
