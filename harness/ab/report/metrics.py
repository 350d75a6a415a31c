"""Metrics: the numbers of a run, computed once from its records, as dataclasses (no formatting here).

`compute_metrics(run)` gives a `RunMetrics`: one `RequestMetrics` per recorded request (the client's
times, the node and rank deltas around it, where the hook's call log saw the growth), the failures, and
the helpers that gather a metric over repeats (`values`, `spread`; `estimate` and `paired`, the t-interval
and the paired difference of harness/ab/report/stats.py). Tables, plots, gates, the demo's notes and the
statistics read these, never the records' fields again.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from harness.ab.records import NodeSnapshot, RankSnapshot, Snapshot, StepKey
from harness.ab.report.hook_calls import CallSeries
from harness.ab.report.load import RunData
from harness.ab.report.stats import Estimate, PairedDifference

T = TypeVar("T")
SnapshotT = TypeVar("SnapshotT", bound=Snapshot)


@dataclass(frozen=True)
class NodeRequestMetrics:
    """One node during one request (from the daemon's scrapes before and after it, and its samples)."""

    mem_available_delta_bytes: float | None  # after - before
    mem_available_min_delta_bytes: float | None  # lowest point during the request - before
    mem_available_min_bytes: float | None  # lowest point during the request (node samples and the scrape after)
    headroom_min_bytes: float | None  # lowest memtel_node_unified_headroom_bytes during the request
    swap_used_delta_bytes: float | None
    max_swap_used_bytes: float | None
    pswpin: float | None  # pages swapped in during the request
    pswpout: float | None
    nv_err_no_memory: float | None  # kernel-log NV_ERR_NO_MEMORY lines during the request
    xid: float | None  # Xid lines during the request
    error: str | None  # a scrape that failed


@dataclass(frozen=True)
class RankRequestMetrics:
    """One rank during one request (from the hook exporter's scrapes before and after it)."""

    reserved_before_bytes: float | None
    reserved_after_bytes: float | None
    reserved_growth_bytes: float | None
    num_device_alloc: float | None  # device allocations during the request
    num_device_alloc_after: float | None  # the counter after the request
    growth_events: float | None
    hook_calls: float | None
    error: str | None


@dataclass(frozen=True)
class HookGrowth:
    """Where one rank's reserved memory grew during one request, from the hook's per-call log."""

    calls: int  # hooked calls inside the request's window
    has_allocator: bool  # False: the calls carry no allocator counters (no CUDA in that process)
    reserved_growth_bytes: int | None = None
    first_call_growth_bytes: int | None = None  # the first call in the window (the first prefill chunk)
    last_call_growth_bytes: int | None = None
    num_device_alloc: int | None = None


@dataclass(frozen=True)
class RequestMetrics:
    """Everything the report knows about one request."""

    arm: str
    repeat: int
    step: str
    ok: bool
    error: str | None
    started_at: float
    ended_at: float
    ttft_client_s: float | None
    ttft_server_s: float | None
    e2e_s: float | None
    prompt_tokens: int  # as built
    usage_prompt_tokens: int | None  # as the server's usage reported
    output_tokens: int | None
    needle_found: bool | None
    prefix_cache_hit_tokens: float | None
    nodes: dict[str, NodeRequestMetrics] = field(default_factory=dict)
    ranks: dict[str, RankRequestMetrics] = field(default_factory=dict)
    hook: dict[int, HookGrowth] = field(default_factory=dict)  # rank (from the call log) ->

    @property
    def key(self) -> StepKey:
        return (self.arm, self.repeat, self.step)

    @property
    def reserved_growth_bytes(self) -> float | None:
        """Reserved growth during the request summed over every rank; None unless every rank's is known."""
        values = [r.reserved_growth_bytes for r in self.ranks.values()]
        if not values or any(v is None for v in values):
            return None
        return float(sum(v for v in values if v is not None))


@dataclass(frozen=True)
class Spread:
    """A metric over repeats: median, min, max and how many values."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Spread | None:
        known = [v for v in values if v is not None]
        if not known:
            return None
        return cls(statistics.median(known), min(known), max(known), len(known))


@dataclass(frozen=True)
class Failure:
    arm: str
    repeat: int
    step: str
    kind: str  # failed, skipped, not run
    reason: str


@dataclass
class RunMetrics:
    run: RunData
    requests: dict[StepKey, RequestMetrics]
    failures: list[Failure]

    def ordered(self) -> list[RequestMetrics]:
        """Requests by repeat, then arm and step in the ladder's order."""
        arms, steps = self.run.arms, self.run.steps
        keys = sorted((k for k in self.requests if k[0] in arms and k[2] in steps),
                      key=lambda k: (k[1], arms.index(k[0]), steps.index(k[2])))
        return [self.requests[k] for k in keys]

    def values(self, arm: str, step: str, pick: Callable[[RequestMetrics], T]) -> list[T]:
        """`pick` of every successful request of (arm, step), one per repeat."""
        out = []
        for repeat in range(self.run.repeats):
            m = self.requests.get((arm, repeat, step))
            if m is not None and m.ok:
                out.append(pick(m))
        return out

    def spread(self, arm: str, step: str, pick: Callable[[RequestMetrics], float | None]) -> Spread | None:
        return Spread.of(self.values(arm, step, pick))

    def estimate(self, arm: str, step: str, pick: Callable[[RequestMetrics], float | None]) -> Estimate | None:
        """Mean, sd and 95 % t-interval of `pick` over the repeats of (arm, step)."""
        return Estimate.of(self.values(arm, step, pick))

    def paired(self, a: str, b: str, step: str, pick: Callable[[RequestMetrics], float | None]) -> PairedDifference:
        """A − B of `pick` over pairs of successful requests of the same repeat at this step."""
        def value(arm: str, repeat: int) -> float | None:
            m = self.requests.get((arm, repeat, step))
            return pick(m) if m is not None and m.ok else None

        return PairedDifference.of(a, b, {r: (value(a, r), value(b, r)) for r in range(self.run.repeats)})

    def block_reserved_growth(self, arm: str, repeat: int) -> float | None:
        """Reserved growth over the whole ladder of one block, all ranks; None unless every step's request
        succeeded with every rank's growth known."""
        total = 0.0
        for step in self.run.steps:
            m = self.requests.get((arm, repeat, step))
            growth = m.reserved_growth_bytes if m is not None and m.ok else None
            if growth is None:
                return None
            total += growth
        return total

    def paired_blocks(self, a: str, b: str) -> PairedDifference:
        """A − B of the reserved growth over the ladder, pairs of the same repeat."""
        return PairedDifference.of(a, b, {r: (self.block_reserved_growth(a, r), self.block_reserved_growth(b, r))
                                          for r in range(self.run.repeats)})

    def rank_total(self, rank: str, arm: str, repeat: int, pick: Callable[[RankRequestMetrics], float | None]
                   ) -> float | None:
        """A rank's metric summed over every request of one (arm, repeat) block; None when none is known."""
        known = [pick(m.ranks[rank]) for s in self.run.steps if (m := self.requests.get((arm, repeat, s)))]
        values = [v for v in known if v is not None]
        return sum(values) if values else None

    @property
    def cold_checked(self) -> dict[StepKey, float]:
        """Prefix-cache hit tokens of every successful request whose server exports them (0: a cold prefill)."""
        return {k: m.prefix_cache_hit_tokens for k, m in self.requests.items()
                if m.ok and m.prefix_cache_hit_tokens is not None}


# --- computing them -------------------------------------------------------------------------------


def _delta(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else after - before


def _change(after: Snapshot | None, before: Snapshot | None, name: str) -> float | None:
    """`name` after minus before, when both scrapes have it."""
    return _delta(getattr(after, name) if after else None, getattr(before, name) if before else None)


def _snapshot(scrape_part: dict[str, SnapshotT] | None, name: str) -> SnapshotT | None:
    snap = (scrape_part or {}).get(name)
    return None if snap is None or snap.error else snap


def _error(*snaps: Snapshot | None) -> str | None:
    return next((s.error for s in snaps if s is not None and s.error), None)


def growth_location(calls: CallSeries, started_at: float, ended_at: float) -> HookGrowth:
    """Where one rank's reserved memory grew between two times, from its per-call log.

    A call's growth is its counters minus those of the call before it in the same process; a process's
    first call has no "before", so its growth is unknown (None), not 0.
    """
    first, end = calls.window(started_at, ended_at)
    if end <= first or not calls.known[first]:
        return HookGrowth(calls=end - first, has_allocator=False)
    index = np.arange(first, end)
    before = np.maximum(index - 1, 0)
    known = calls.known
    has_before = (index > 0) & (calls.pid[index] == calls.pid[before]) & known[index] & known[before]

    def growth(values: np.ndarray) -> np.ndarray:
        return values[index] - values[before]

    def total(values: np.ndarray) -> int | None:
        return int(growth(values)[has_before].sum()) if has_before.any() else None

    reserved = growth(calls.reserved_bytes)
    return HookGrowth(calls=end - first, has_allocator=True, reserved_growth_bytes=total(calls.reserved_bytes),
                      first_call_growth_bytes=int(reserved[0]) if has_before[0] else None,
                      last_call_growth_bytes=int(reserved[-1]) if has_before[-1] else None,
                      num_device_alloc=total(calls.num_device_alloc))


def request_metrics(run: RunData, key: StepKey) -> RequestMetrics:
    arm, repeat, step = key
    req = run.requests[key]
    before = run.scrape_before(arm, repeat, req.started_at)
    after = run.scrape_after(arm, repeat, step)
    nodes = {}
    for node in run.nodes:
        b: NodeSnapshot | None = _snapshot(before.nodes if before else None, node)
        a: NodeSnapshot | None = _snapshot(after.nodes if after else None, node)
        start = b.mem_available_bytes if b else None
        lows = [v for v in (req.min_mem_available_bytes.get(node), a.mem_available_bytes if a else None)
                if v is not None]
        during = [s.snapshot for s in run.samples.get((arm, repeat, node), ()) if s.step == step] + ([a] if a else [])
        headrooms = [s.unified_headroom_bytes for s in during if s.unified_headroom_bytes is not None]
        nodes[node] = NodeRequestMetrics(
            mem_available_delta_bytes=_delta(a.mem_available_bytes if a else None, start),
            mem_available_min_delta_bytes=(min(lows) - start) if lows and start is not None else None,
            mem_available_min_bytes=min(lows) if lows else None,
            headroom_min_bytes=min(headrooms) if headrooms else None,
            swap_used_delta_bytes=_change(a, b, "swap_used_bytes"),
            max_swap_used_bytes=req.max_swap_used_bytes.get(node),
            pswpin=_change(a, b, "pswpin_total"),
            pswpout=_change(a, b, "pswpout_total"),
            nv_err_no_memory=_change(a, b, "nv_err_no_memory_total"),
            xid=_change(a, b, "xid_total"),
            error=_error((after.nodes.get(node) if after else None), (before.nodes.get(node) if before else None)))
    ranks = {}
    for rank in run.ranks:
        rb: RankSnapshot | None = _snapshot(before.ranks if before else None, rank)
        ra: RankSnapshot | None = _snapshot(after.ranks if after else None, rank)
        ranks[rank] = RankRequestMetrics(
            reserved_before_bytes=rb.reserved_bytes if rb else None,
            reserved_after_bytes=ra.reserved_bytes if ra else None,
            reserved_growth_bytes=_change(ra, rb, "reserved_bytes"),
            num_device_alloc=_change(ra, rb, "num_device_alloc"),
            num_device_alloc_after=ra.num_device_alloc if ra else None,
            growth_events=_change(ra, rb, "growth_events_total"),
            hook_calls=_change(ra, rb, "hook_calls_total"),
            error=_error((after.ranks.get(rank) if after else None), (before.ranks.get(rank) if before else None)))
    hook = {rank_id: growth_location(calls, req.started_at, req.ended_at)
            for rank_id, calls in sorted(run.hook_calls(arm, repeat).items())}
    return RequestMetrics(
        arm=arm, repeat=repeat, step=step, ok=req.ok, error=req.error, started_at=req.started_at,
        ended_at=req.ended_at, ttft_client_s=req.ttft_s, ttft_server_s=req.server_ttft_s, e2e_s=req.e2e_s,
        prompt_tokens=req.prompt_tokens, usage_prompt_tokens=req.usage_prompt_tokens,
        output_tokens=req.output_tokens, needle_found=req.needle_found,
        prefix_cache_hit_tokens=req.prefix_cache_hit_tokens, nodes=nodes, ranks=ranks, hook=hook)


def failures(run: RunData, requests: dict[StepKey, RequestMetrics]) -> list[Failure]:
    out = [Failure(m.arm, m.repeat, m.step, "failed", m.error or "unknown error")
           for m in sorted(requests.values(), key=lambda m: m.started_at) if not m.ok]
    out += [Failure(arm, repeat, step, "skipped", why) for (arm, repeat, step), why in run.skipped.items()]
    out += [Failure(arm, repeat, step, "not run", "not run yet")
            for repeat in range(run.repeats) for arm in run.arms for step in run.steps
            if (arm, repeat, step) not in run.requests and (arm, repeat, step) not in run.skipped]
    return out


def compute_metrics(run: RunData) -> RunMetrics:
    requests = {key: request_metrics(run, key) for key in run.requests}
    return RunMetrics(run, requests, failures(run, requests))


__all__ = ["Failure", "HookGrowth", "NodeRequestMetrics", "RankRequestMetrics", "RequestMetrics",
           "RunMetrics", "Spread", "compute_metrics", "growth_location", "request_metrics"]
