"""Prometheus sink of the hook: per-site state updated on the hot path, families built at scrape.

The hot path only updates plain numbers in a `SiteStats` (under the recorder's lock); the collector
turns a snapshot of them into fresh metric families on every scrape, the way prometheus_client's
custom collectors do. The exporter is started lazily, on the first record of a process, on
`MEMTEL_PORT + local rank`, so only processes that run a hooked function listen, and the ranks of
one node never clash. Metric names are fixed in docs/architecture.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

log = logging.getLogger("memtel.hook")

MiB = 1 << 20
GiB = 1 << 30
# Per-call change of reserved bytes: 0 for most calls, else a segment's worth (2 MiB small pool,
# 20 MiB+ large pool, the logits' size for big chunks). A decrease (empty_cache, OOM-retry frees) is
# observed as 0: Prometheus histograms with negative buckets lose their _sum and _count.
RESERVED_DELTA_BUCKETS = (0, MiB, 2 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, GiB, 4 * GiB, 16 * GiB)


@dataclass(slots=True)  # slots: faster attribute updates on the hot path
class SiteStats:
    """What the hook knows about one site (hooked target) in this process.

    Updated in place by the hook's hot path (record.Recorder.record), under HookStats.lock.
    """

    calls: int = 0
    growth_events: int = 0
    allocator: tuple | None = None   # allocator.FIELDS values after the last call
    mem_available_bytes: int | None = None
    swap_free_bytes: int | None = None
    delta_buckets: list = field(default_factory=lambda: [0] * (len(RESERVED_DELTA_BUCKETS) + 1))
    delta_sum: int = 0   # the histogram's count is the sum of its buckets (one counter less per call)

    def copy(self) -> SiteStats:
        return SiteStats(self.calls, self.growth_events, self.allocator, self.mem_available_bytes,
                         self.swap_free_bytes, list(self.delta_buckets), self.delta_sum)


@dataclass
class HookStats:
    """All of the hook's numbers in one process; guarded by `lock` (the recorder's)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    sites: dict = field(default_factory=dict)            # site -> SiteStats
    errors: dict = field(default_factory=dict)           # (site, stage) -> count
    install_failures: dict = field(default_factory=dict)  # (target, reason) -> count
    dropped_records: Callable[[], int] = lambda: 0

    def count_error(self, site: str, stage: str) -> None:
        with self.lock:
            self.errors[(site, stage)] = self.errors.get((site, stage), 0) + 1

    def count_install_failure(self, target: str, reason: str) -> None:
        with self.lock:
            key = (target, reason)
            self.install_failures[key] = self.install_failures.get(key, 0) + 1

    def snapshot(self) -> tuple[dict, dict, dict]:
        with self.lock:
            return ({site: s.copy() for site, s in self.sites.items()}, dict(self.errors),
                    dict(self.install_failures))


_ALLOCATOR_GAUGES = (
    (0, "memtel_allocator_reserved_bytes", "Bytes reserved by the caching allocator after the last hooked call."),
    (1, "memtel_allocator_allocated_bytes", "Bytes allocated to tensors after the last hooked call."),
)
_ALLOCATOR_COUNTERS = (
    (2, "memtel_allocator_device_alloc", "The allocator's num_device_alloc: device mallocs (segments mapped) so far."),
    (3, "memtel_allocator_device_free", "The allocator's num_device_free: device frees (segments released) so far."),
    (4, "memtel_allocator_alloc_retries", "The allocator's num_alloc_retries: mallocs retried after freeing the cache."),
    (5, "memtel_allocator_ooms", "The allocator's num_ooms: out-of-memory errors raised by the allocator."),
)


class HookCollector(Collector):
    """Builds the hook's metric families from a snapshot of `HookStats` on every scrape."""

    def __init__(self, stats: HookStats, labels: Callable[[], tuple[str, str]]) -> None:
        self.stats = stats
        self.labels = labels  # () -> (rank, node), resolved at scrape time

    def collect(self):
        sites, errors, failures = self.stats.snapshot()
        rank, node = self.labels()
        names = ["site", "rank", "node"]
        gauges = {i: GaugeMetricFamily(n, h, labels=names) for i, n, h in _ALLOCATOR_GAUGES}
        counters = {i: CounterMetricFamily(n, h, labels=names) for i, n, h in _ALLOCATOR_COUNTERS}
        available = GaugeMetricFamily("memtel_hook_host_mem_available_bytes",
                                      "Host MemAvailable after the last hooked call.", labels=names)
        swap_free = GaugeMetricFamily("memtel_hook_host_swap_free_bytes",
                                      "Host SwapFree after the last hooked call.", labels=names)
        calls = CounterMetricFamily("memtel_hook_calls", "Hooked calls recorded.", labels=names)
        growth = CounterMetricFamily("memtel_hook_growth_events",
                                     "Hooked calls during which the allocator's num_device_alloc rose.",
                                     labels=names)
        delta = HistogramMetricFamily("memtel_hook_reserved_delta_bytes",
                                      "Per-call growth of the allocator's reserved bytes (a decrease counts as 0).", labels=names)
        for site, s in sorted(sites.items()):
            values = [site, rank, node]
            calls.add_metric(values, s.calls)
            if s.allocator is not None:  # absent, not 0, without an allocator
                growth.add_metric(values, s.growth_events)
                for i, family in gauges.items():
                    family.add_metric(values, s.allocator[i])
                for i, family in counters.items():
                    family.add_metric(values, s.allocator[i])
                cumulative, buckets = 0, []
                for bound, count in zip(RESERVED_DELTA_BUCKETS + (float("inf"),), s.delta_buckets):
                    cumulative += count
                    buckets.append(("+Inf" if bound == float("inf") else str(float(bound)), cumulative))
                delta.add_metric(values, buckets, s.delta_sum)
            if s.mem_available_bytes is not None:
                available.add_metric(values, s.mem_available_bytes)
            if s.swap_free_bytes is not None:
                swap_free.add_metric(values, s.swap_free_bytes)
        yield from gauges.values()
        yield from counters.values()
        yield from (available, swap_free, calls, growth, delta)
        errors_family = CounterMetricFamily("memtel_hook_errors",
                                            "Errors inside the hook, caught and counted, never raised.",
                                            labels=["site", "stage", "rank", "node"])
        for (site, stage), count in sorted(errors.items()):
            errors_family.add_metric([site, stage, rank, node], count)
        yield errors_family
        failures_family = CounterMetricFamily("memtel_hook_install_failures",
                                              "Hook targets that could not be installed.",
                                              labels=["target", "reason", "rank", "node"])
        for (target, reason), count in sorted(failures.items()):
            failures_family.add_metric([target, reason, rank, node], count)
        yield failures_family
        dropped = CounterMetricFamily("memtel_hook_log_dropped_records",
                                      "Per-call log records dropped because the writer fell behind.",
                                      labels=["rank", "node"])
        dropped.add_metric([rank, node], self.stats.dropped_records())
        yield dropped


class Exporter:
    """The hook's /metrics endpoint of this process, started once, on base port + local rank."""

    def __init__(self, collector: HookCollector, base_port: int, addr: str = "0.0.0.0") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(collector)
        self.base_port = base_port
        self.addr = addr
        self.port: int | None = None
        self._server = None
        self._thread = None

    def start(self, local_rank: int) -> int:
        from prometheus_client import start_http_server

        port = self.base_port + local_rank
        if not 0 < port < 65536:
            raise OSError(f"exporter port {self.base_port} + local rank {local_rank} = {port} is not a valid port")
        started = start_http_server(port, addr=self.addr, registry=self.registry)
        if isinstance(started, tuple):  # prometheus_client >= 0.18 hands back the server to stop it
            self._server, self._thread = started
        self.port = port
        log.info("memtel hook exporter listening on %s:%d", self.addr, port)
        return port

    def reset_after_fork(self) -> None:
        """In a forked child: close the inherited listening socket; the parent keeps serving."""
        if self._server is not None:
            self._server.socket.close()
        self._server = self._thread = None
        self.port = None

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
