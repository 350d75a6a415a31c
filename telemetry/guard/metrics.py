"""The guard's own Prometheus metrics: what it admitted and refused, the limit in force, its blind time.

The proxy's event loop counts into `GuardMetrics` (plain counts under a lock); `GuardCollector` builds
fresh families from those counts and from what the limit tracker last published on every scrape, so a
scrape (on the exporter's threads) never touches the hooks or the loop. Names, types and help texts are
the catalogue's (telemetry/catalogue/metrics.py, "the guard"); docs/guard.md lists them.
"""

from __future__ import annotations

import bisect
import collections
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from telemetry.admission.at_best import best_replica
from telemetry.catalogue import described
from telemetry.catalogue import metrics as catalogue
from telemetry.catalogue.family import Family, HistogramFamily
from telemetry.guard.limit import LimitTracker

# The guard adds well under a millisecond when it forwards by the byte bound, and an upstream /tokenize
# call (milliseconds to a second for a long prompt) when it has to count.
ADDED_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                         2.5, 5.0)
QUEUE_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
HISTOGRAM_BUCKETS: dict[HistogramFamily, tuple[float, ...]] = {catalogue.GUARD_ADDED_LATENCY: ADDED_LATENCY_BUCKETS,
                                                      catalogue.GUARD_QUEUE_WAIT: QUEUE_WAIT_BUCKETS}
# Label values exported even at 0, so a rate() sees the first one.
FIXED_LABELS: dict[Family, tuple[tuple[str, ...], ...]] = {
    catalogue.GUARD_REJECTED: (("context_length_exceeded",), ("exceeds_memory_at_best",), ("would_not_fit",),
                               ("in_prefill",), ("blind",), ("bad_request",), ("not_forwarded",)),
    catalogue.GUARD_BLIND_DECISIONS: (("admit",), ("reject",)),
    catalogue.GUARD_UPSTREAM_FAILURES: (("connect",), ("request",), ("body",), ("tokenize",)),
    catalogue.GUARD_CONNECTIONS: (("evicted",), ("refused",)),
    catalogue.GUARD_PASSED_THROUGH: ((),),
    catalogue.GUARD_TOKENIZE_CALLS: ((),),
    catalogue.GUARD_QUEUE_OUTCOMES: (("admitted",), ("timed_out",), ("client_left",), ("queue_full",), ("refused",)),
}


class GuardMetrics:
    """Counts the proxy keeps: by catalogue family and label values, its histograms, and the queue's depth."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[tuple[Family, tuple[str, ...]]] = collections.Counter()
        self._histograms: dict[HistogramFamily, tuple[list[int], float]] = {
            family: ([0] * (len(bounds) + 1), 0.0) for family, bounds in HISTOGRAM_BUCKETS.items()}
        self.queue_depth = 0  # written on the loop by the queue, read by scrapes

    def count(self, family: Family, *labels: str) -> None:
        with self._lock:
            self._counts[(family, labels)] += 1

    def observe(self, family: HistogramFamily, seconds: float) -> None:
        with self._lock:
            buckets, total = self._histograms[family]
            buckets[bisect.bisect_left(HISTOGRAM_BUCKETS[family], seconds)] += 1
            self._histograms[family] = (buckets, total + seconds)

    def observe_added(self, seconds: float) -> None:
        self.observe(catalogue.GUARD_ADDED_LATENCY, seconds)

    def counts(self) -> dict[tuple[Family, tuple[str, ...]], int]:
        with self._lock:
            return dict(self._counts)

    def histogram(self, family: HistogramFamily) -> tuple[list[int], float]:
        with self._lock:
            buckets, total = self._histograms[family]
            return list(buckets), total

    def latency(self) -> tuple[list[int], float]:
        return self.histogram(catalogue.GUARD_ADDED_LATENCY)


class ReplicaState(Protocol):
    """What the metrics read of a replica (telemetry/guard/replicas.py)."""

    name: str
    tracker: LimitTracker
    healthy: bool


class GuardCollector(Collector):
    """The guard's families, built fresh on every scrape."""

    def __init__(self, metrics: GuardMetrics, tracker: LimitTracker,
                 replicas: Sequence[ReplicaState] = ()) -> None:
        self.metrics = metrics
        self.tracker = tracker
        self.replicas = replicas  # with two or more, the limit families sum or pick over them (docs/guard.md)

    def collect(self) -> Iterator[Metric]:
        yield from self._counters()
        yield self._histogram(catalogue.GUARD_ADDED_LATENCY)
        yield self._histogram(catalogue.GUARD_QUEUE_WAIT)
        yield catalogue.GUARD_QUEUE_DEPTH.new(self.metrics.queue_depth)
        if len(self.replicas) > 1:
            yield from self._replicas()
        else:
            yield from self._limit()
        trackers = [r.tracker for r in self.replicas] or [self.tracker]
        best = best_replica([t.published_at_best for t in trackers])  # the deployment's (at_best.py)
        if best is not None:
            at_best = catalogue.GUARD_LIMIT_TOKENS_AT_BEST.new()
            at_best.add_metric([best.node, best.rank], best.tokens)
            yield at_best

    def _counters(self) -> Iterator[Metric]:
        counts = self.metrics.counts()
        for family in (catalogue.GUARD_ADMITTED, catalogue.GUARD_REJECTED, catalogue.GUARD_BLIND_DECISIONS,
                       catalogue.GUARD_PASSED_THROUGH, catalogue.GUARD_TOKENIZE_CALLS,
                       catalogue.GUARD_UPSTREAM_FAILURES, catalogue.GUARD_CONNECTIONS, catalogue.GUARD_QUEUE_OUTCOMES,
                       catalogue.GUARD_REPLICA_FORWARDED):
            values = {labels: 0 for labels in FIXED_LABELS.get(family, ())}
            values.update({labels: n for (f, labels), n in counts.items() if f == family})
            if not family.labels:
                yield family.new(values.get((), 0))
                continue
            metric = family.new()
            for labels, n in sorted(values.items()):
                metric.add_metric(list(labels), n)
            yield metric

    def _histogram(self, family: HistogramFamily) -> Metric:
        buckets, total = self.metrics.histogram(family)
        metric = family.new()
        cumulative, running = [], 0
        for bound, n in zip((*HISTOGRAM_BUCKETS[family], float("inf")), buckets, strict=True):
            running += n
            cumulative.append(("+Inf" if bound == float("inf") else repr(bound), running))
        metric.add_metric([], cumulative, total)
        return metric

    def _limit(self) -> Iterator[Metric]:
        tracker = self.tracker
        limit = tracker.published
        if limit is not None:
            yield catalogue.GUARD_LIMIT_TOKENS.new(limit.tokens)
            limiting = catalogue.GUARD_MAX_PREFILL_TOKENS.new()
            limiting.add_metric([limit.fit.node, limit.fit.rank], limit.rank_tokens)
            yield limiting
        yield catalogue.GUARD_IN_PREFILL_TOKENS.new(tracker.in_prefill_tokens)
        yield catalogue.GUARD_HOOKS.new(len(tracker.hooks))
        yield catalogue.GUARD_FRESH_RANKS.new(tracker.published_fresh)
        yield catalogue.GUARD_BLIND.new(1 if tracker.blind else 0)
        yield catalogue.GUARD_BLIND_SECONDS.new(tracker.blind_seconds_now(time.monotonic()))
        yield catalogue.GUARD_BLIND_EPISODES.new(tracker.blind_episodes)
        yield catalogue.GUARD_HOOKS_WITHOUT_GAUGE.new(len(tracker.without_gauge()))
        failures = catalogue.GUARD_HOOK_SCRAPE_FAILURES.new()
        for hook in tracker.hooks:
            failures.add_metric([hook.target.url], hook.failures)
        yield failures

    def _replicas(self) -> Iterator[Metric]:
        """Several replicas: the longest prompt admitted anywhere, sums of the rest, and each replica's own."""
        trackers = [r.tracker for r in self.replicas]
        published = [(t.published, t) for t in trackers if t.published is not None]
        if published:
            limit = max((p for p, _t in published), key=lambda p: p.tokens)
            yield catalogue.GUARD_LIMIT_TOKENS.new(limit.tokens)
            limiting = catalogue.GUARD_MAX_PREFILL_TOKENS.new()
            limiting.add_metric([limit.fit.node, limit.fit.rank], limit.rank_tokens)
            yield limiting
        now = time.monotonic()
        yield catalogue.GUARD_IN_PREFILL_TOKENS.new(sum(t.in_prefill_tokens for t in trackers))
        yield catalogue.GUARD_HOOKS.new(sum(len(t.hooks) for t in trackers))
        yield catalogue.GUARD_FRESH_RANKS.new(sum(t.published_fresh for t in trackers))
        yield catalogue.GUARD_BLIND.new(1 if all(t.blind for t in trackers) else 0)
        yield catalogue.GUARD_BLIND_SECONDS.new(sum(t.blind_seconds_now(now) for t in trackers))
        yield catalogue.GUARD_BLIND_EPISODES.new(sum(t.blind_episodes for t in trackers))
        yield catalogue.GUARD_HOOKS_WITHOUT_GAUGE.new(sum(len(t.without_gauge()) for t in trackers))
        failures = catalogue.GUARD_HOOK_SCRAPE_FAILURES.new()
        for tracker in trackers:
            for hook in tracker.hooks:
                failures.add_metric([hook.target.url], hook.failures)
        yield failures
        in_pool = catalogue.GUARD_REPLICA_IN_POOL.new()
        room = catalogue.GUARD_REPLICA_LIMIT_TOKENS.new()
        for replica in self.replicas:
            limit_now = replica.tracker.published
            in_pool.add_metric([replica.name], 1 if replica.healthy and limit_now is not None else 0)
            if limit_now is not None:
                room.add_metric([replica.name], limit_now.tokens)
        yield in_pool
        yield room

    def describe(self) -> list[Metric]:
        """The catalogue's guard families (those of several replicas too), without collecting."""
        return described("guard")


def guard_registry(metrics: GuardMetrics, tracker: LimitTracker,
                   replicas: Sequence[ReplicaState] = ()) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GuardCollector(metrics, tracker, replicas))
    return registry


__all__ = ["ADDED_LATENCY_BUCKETS", "QUEUE_WAIT_BUCKETS", "GuardCollector", "GuardMetrics", "ReplicaState",
           "guard_registry"]
