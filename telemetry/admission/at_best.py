"""The most a deployment could ever take: each rank's `memtel_forecast_max_prefill_tokens_at_best`, read only where
it can be trusted, so that a prompt over it can be refused for good (400) instead of waiting in vain.

A rank's at-best (telemetry/hook/forecast/compute.py) is the longest prefill that would fit with its allocator's
cache released; the live blocks stay. A snapshot taken while a prefill runs holds that prefill's activations as
live blocks, so its at-best is too low, and a permanent refusal on it would turn away a prompt that fits once
that prefill ends: worse than a 503. So the guard keeps, per rank, only **clean** readings, taken while it had no
prefill in flight on that replica (no admitted request between its admission and the first byte of its answer,
those admitted blind included), with `CLEAN_SLACK_S` of margin on each side (the hook's node's clock against the
guard's, and the snapshot read just after the time it is stamped with); and of those it uses the **highest
within `window_s`** (default `AT_BEST_WINDOW_S`, five minutes): a reading that is low for a passing reason
(decode steps, a request that reached the engine around the guard, and above all another process that holds
part of the node's memory for a while: the hook's budget is the memory free now) is outweighed by a higher one,
and a rise is used at once. Only memory held for longer than the window lowers it. Nor is a rank taken below
what its gauges say now (any reading, clean or not, is a lower bound of what it takes at rest).

A replica's at-best is its smallest rank's (a tensor-parallel prefill runs on every rank); it is known only while
every hook of the replica is fresh, every rank exports the gauge (an older hook does not) and every rank has a clean
reading within the window. The deployment's is the best replica's, and is known only where every replica's is
(`replica_at_best` and `deployment_at_best`, in readings.py, from a replica's readings). Unknown: the refusal is
transient, as before the gauge existed. `--reserve-mb` is not applied to it: a permanent answer claims no memory
could take the prompt, so it rests on the larger figure.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

AT_BEST_WINDOW_S = 300.0  # the highest clean reading of the last five minutes stands
# NTP-synced clocks differ by milliseconds, and a snapshot is read milliseconds after the time it is stamped with;
# the admission comes before the prefill and the release after it, so the span itself already covers the prefill.
CLEAN_SLACK_S = 0.5
MAX_BUSY_SPANS = 256  # spans of prefills in flight remembered (older ones are past the window anyway)


class RankReading(Protocol):
    """What the book reads of one rank's forecast (readings.py's `RankFit`)."""

    @property
    def rank(self) -> str: ...
    @property
    def node(self) -> str: ...
    @property
    def max_prefill_tokens(self) -> int: ...
    @property
    def forecast_time(self) -> float | None: ...
    @property
    def at_best_tokens(self) -> int | None: ...


@dataclass(frozen=True)
class AtBest:
    """The most a replica (or the deployment) could take: `tokens`, set by `rank` on `node`, read from `hook` in a
    snapshot taken at unix time `measured_at` while the guard had no prefill in flight there."""

    tokens: int
    rank: str
    node: str
    hook: str
    measured_at: float


class AtBestBook:
    """One replica's clean at-best readings and the spans in which the guard had prefills in flight there.

    Every method takes `now`, the unix time (the hooks stamp their snapshots with it): the book reads no clock.
    """

    def __init__(self, window_s: float = AT_BEST_WINDOW_S) -> None:
        self.window_s = window_s
        self._spans: list[list[float]] = []  # [start, end] unix times; the last one's end is inf while in flight
        self._readings: dict[tuple[str, str, str], dict[float, int]] = {}  # (hook, rank, node): {measured_at: tokens}
        self.in_flight = 0  # admitted requests still in their prefill

    # -- prefills in flight ---------------------------------------------------------------------------------
    def started(self, now: float) -> None:
        """A request was admitted to this replica (its prefill starts)."""
        self.in_flight += 1
        if self.in_flight == 1:
            self._spans.append([now, float("inf")])
            del self._spans[:-MAX_BUSY_SPANS]

    def ended(self, now: float) -> None:
        """An admitted request's prefill is over (or it never ran)."""
        if self.in_flight == 0:
            return
        self.in_flight -= 1
        if self.in_flight == 0 and self._spans:
            self._spans[-1][1] = now

    def clean(self, measured_at: float) -> bool:
        """Whether a snapshot taken at `measured_at` was taken with no prefill of the guard's in flight."""
        return not any(start - CLEAN_SLACK_S <= measured_at <= end + CLEAN_SLACK_S for start, end in self._spans)

    # -- readings -------------------------------------------------------------------------------------------
    def observe(self, hook: str, fits: Iterable[RankReading], now: float) -> None:
        """Keep the clean at-best readings of a hook's answer; forget those past the window."""
        for fit in fits:
            at = fit.forecast_time
            if fit.at_best_tokens is None or at is None:
                continue
            readings = self._readings.setdefault((hook, fit.rank, fit.node), {})
            if at not in readings and self.clean(at):
                readings[at] = max(fit.at_best_tokens, fit.max_prefill_tokens)
        oldest = now - self.window_s
        for key, readings in list(self._readings.items()):
            for at in [at for at in readings if at < oldest]:
                del readings[at]
            if not readings:
                del self._readings[key]
        self._spans = [span for span in self._spans if span[1] + CLEAN_SLACK_S >= oldest]

    def best(self, hook: str, fit: RankReading, now: float) -> tuple[int, float] | None:
        """(the highest clean reading of this rank within the window, when it was measured), or None."""
        readings = self._readings.get((hook, fit.rank, fit.node))
        oldest = now - self.window_s
        found = [(tokens, at) for at, tokens in (readings or {}).items() if at >= oldest]
        return max(found) if found else None


def best_replica(replicas: Sequence[AtBest | None]) -> AtBest | None:
    """The deployment's at-best from its replicas': the best one's, None unless every one's is known."""
    if not replicas or any(best is None for best in replicas):
        return None
    return max((best for best in replicas if best is not None), key=lambda a: a.tokens)


__all__ = ["AT_BEST_WINDOW_S", "CLEAN_SLACK_S", "AtBest", "AtBestBook", "RankReading", "best_replica"]
