"""Is a node's engine stalled? MemtelEngineStalled's definition, applied by `memtel top` between its frames.

The rule (telemetry/alerts/rules/memtel-alerts.yml) and this module say the same thing, per node: requests have
been running all along and for WINDOW_S nothing moved: no generated token, no prompt token computed, no engine
step and no hooked call (PROGRESS_SERIES). The rule then waits FOR_S more before it pages; top says STALLED as soon as
the rule's condition holds (the alert pending). tests/ledger/test_top_stall.py checks that the rule's window,
`for` and series are these.

Top knows only what it has watched: a stall that began before it started is counted from its first frame. A
counter that cannot be read (an unreachable hook: a stopped rank's exporter does not answer) is not progress;
a counter that changes either way (an engine restarted) is. With no engine answering, nothing is decided.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from telemetry.catalogue import Family
from telemetry.catalogue.metrics import HOOK_CALLS
from telemetry.catalogue.vllm import GENERATION_TOKENS, ITERATION_TOKENS, NUM_REQUESTS_RUNNING, PROMPT_TOKENS
from telemetry.scrape import Exposition, series_name

WINDOW_S = 180.0  # the rule's range: [3m]
FOR_S = 60.0      # the rule's `for: 1m`
RUNNING = NUM_REQUESTS_RUNNING
# Progress, each as (entry, histogram part): read from the engine's /metrics ...
ENGINE_PROGRESS: tuple[tuple[Family, str | None], ...] = (
    (GENERATION_TOKENS, None), (PROMPT_TOKENS, None), (ITERATION_TOKENS, "_count"))  # vLLM counts every step here
HOOK_PROGRESS: tuple[Family, str | None] = (HOOK_CALLS, None)                          # ... and from each rank's hook
PROGRESS_SERIES = tuple(series_name(entry, part) for entry, part in (*ENGINE_PROGRESS, HOOK_PROGRESS))


@dataclass(frozen=True)
class EngineState:
    """What a node's engines were doing at one frame."""

    running: float | None        # requests running (the least over the node's engines, as the rule takes it)
    quiet_s: float | None = None  # seconds with requests running and no progress seen (None: not running)
    window_s: float = WINDOW_S

    @property
    def stalled(self) -> bool:
        return self.quiet_s is not None and self.quiet_s >= self.window_s

    def text(self) -> str:
        if self.running is None:
            return "requests running unknown"
        running = f"{self.running:g} request{'' if self.running == 1 else 's'} running"
        if self.quiet_s is None or self.running <= 0:
            return running
        if self.stalled:
            return f"STALLED for {duration(self.quiet_s)} ({running}, no progress)"
        if self.quiet_s < 1:
            return f"{running}, progressing"
        return f"{running}, no progress for {duration(self.quiet_s)} (stalled at {duration(self.window_s)})"


def duration(seconds: float) -> str:
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


@dataclass
class _Node:
    known: dict[str, float] = field(default_factory=dict)  # last value seen of each counter
    quiet_since: float | None = None                       # requests running, nothing moved since then


@dataclass
class StallWatch:
    """The memory top keeps between frames for the stall: per node, the counters last seen and since when
    requests have run without any of them moving. `window_s` is the rule's window (a test shortens both)."""

    window_s: float = WINDOW_S
    nodes: dict[str, _Node] = field(default_factory=dict)

    def observe(self, node: str, at: float, running: float | None,
                counters: Mapping[str, float | None]) -> EngineState:
        """One frame of a node: `running` requests (None: no engine answered), `counters` every progress counter
        by a key unique on the node (None: not readable now), at time `at` (seconds)."""
        memory = self.nodes.setdefault(node, _Node())
        moved = False
        for key, value in counters.items():
            if value is None:
                continue
            before = memory.known.get(key)
            if before is not None and value != before:
                moved = True
            memory.known[key] = value
        if running is None or running <= 0:
            memory.quiet_since = None
            return EngineState(running, None, self.window_s)
        if moved or memory.quiet_since is None:
            memory.quiet_since = at
        return EngineState(running, at - memory.quiet_since, self.window_s)


def engine_numbers(engine: Exposition) -> tuple[float | None, dict[str, float | None]]:
    """An engine's requests running and its progress counters by series name (each summed over its series;
    None: absent, or a value no count can have)."""
    def total(entry: Family, part: str | None = None) -> float | None:
        value = engine.total(entry, part)
        return value if value is not None and math.isfinite(value) and value >= 0 else None

    return total(RUNNING), {series_name(entry, part): total(entry, part) for entry, part in ENGINE_PROGRESS}


__all__ = ["ENGINE_PROGRESS", "FOR_S", "HOOK_PROGRESS", "PROGRESS_SERIES", "RUNNING", "WINDOW_S", "EngineState",
           "StallWatch", "duration", "engine_numbers"]
