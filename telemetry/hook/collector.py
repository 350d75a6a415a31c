"""The hook's Prometheus metrics: fresh families from a snapshot of the state on every scrape.

Nothing is cached between scrapes (the way prometheus_client's custom collectors work). Series whose
source is absent are left out, never reported as 0: allocator series without an allocator, the
unresolved-targets gauge before the unresolved check ran, the log's dropped records without a log.
Metric names are fixed in docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from telemetry.hook import allocator
from telemetry.hook.rank import resolve_rank
from telemetry.hook.state import INSTALLED, RESERVED_DELTA_BUCKETS, HookState

# The growth-event definition, used word for word in docs/hook.md and docs/architecture.md.
GROWTH_EVENTS_HELP = ("Hooked calls of this site after which the allocator's num_device_alloc was higher than after "
                      "the previous hooked call of any target in this process (or than at install, for the first).")

# (AllocatorCounters field, metric, help)
_ALLOCATOR_GAUGES = (
    ("reserved_bytes", "memtel_allocator_reserved_bytes",
     "Bytes reserved by the caching allocator after the site's last hooked call."),
    ("allocated_bytes", "memtel_allocator_allocated_bytes",
     "Bytes allocated to tensors after the site's last hooked call."),
)
_ALLOCATOR_COUNTERS = (
    ("num_device_alloc", "memtel_allocator_device_alloc",
     "The allocator's num_device_alloc after the site's last hooked call: device allocations (segments mapped) "
     "so far."),
    ("num_device_free", "memtel_allocator_device_free",
     "The allocator's num_device_free after the site's last hooked call: device frees (segments released) so far."),
    ("num_alloc_retries", "memtel_allocator_alloc_retries",
     "The allocator's num_alloc_retries: allocations retried after freeing the cache."),
    ("num_ooms", "memtel_allocator_ooms", "The allocator's num_ooms: out-of-memory errors raised by the allocator."),
)


class HookCollector(Collector):
    """Builds the hook's metric families from `state` (and which allocator reader is bound) on every scrape."""

    def __init__(self, state: HookState, reader: Callable[[], object] = allocator.current_reader) -> None:
        self.state = state
        self.reader = reader

    def collect(self) -> Iterator[Metric]:
        snap = self.state.snapshot()
        rank = str((snap.rank or resolve_rank()).rank)
        node = self.state.node
        names = ["site", "rank", "node"]
        gauges = [(f, GaugeMetricFamily(n, h, labels=names)) for f, n, h in _ALLOCATOR_GAUGES]
        counters = [(f, CounterMetricFamily(n, h, labels=names)) for f, n, h in _ALLOCATOR_COUNTERS]
        available = GaugeMetricFamily("memtel_hook_host_mem_available_bytes",
                                      "Host MemAvailable after the site's last hooked call.", labels=names)
        swap_free = GaugeMetricFamily("memtel_hook_host_swap_free_bytes",
                                      "Host SwapFree after the site's last hooked call.", labels=names)
        calls = CounterMetricFamily("memtel_hook_calls", "Hooked calls recorded.", labels=names)
        growth = CounterMetricFamily("memtel_hook_growth_events", GROWTH_EVENTS_HELP, labels=names)
        delta = HistogramMetricFamily("memtel_hook_reserved_delta_bytes",
                                      "Per-call growth of the allocator's reserved bytes since the previous hooked "
                                      "call of any target in this process (a decrease counts as 0).", labels=names)
        for site, s in sorted(snap.sites.items()):
            values = [site, rank, node]
            calls.add_metric(values, s.calls)
            if s.allocator is not None:  # absent, not 0, without an allocator
                growth.add_metric(values, s.growth_events)
                for name, gauge in gauges:
                    gauge.add_metric(values, getattr(s.allocator, name))
                for name, counter in counters:
                    counter.add_metric(values, getattr(s.allocator, name))
                cumulative, buckets = 0, []
                for bound, count in zip((*RESERVED_DELTA_BUCKETS, float("inf")), s.delta_buckets, strict=True):
                    cumulative += count
                    buckets.append(("+Inf" if bound == float("inf") else str(float(bound)), cumulative))
                delta.add_metric(values, buckets, s.delta_sum)
            if s.mem_available_bytes is not None:
                available.add_metric(values, s.mem_available_bytes)
            if s.swap_free_bytes is not None:
                swap_free.add_metric(values, s.swap_free_bytes)
        yield from (gauge for _, gauge in gauges)
        yield from (counter for _, counter in counters)
        yield from (available, swap_free, calls, growth, delta)

        errors = CounterMetricFamily("memtel_hook_errors", "Errors inside the hook, caught and counted, never raised.",
                                     labels=["site", "stage", "rank", "node"])
        for (site, stage), count in sorted(snap.errors.items()):
            errors.add_metric([site, stage, rank, node], count)
        yield errors
        failures = CounterMetricFamily("memtel_hook_install_failures", "Hook targets that could not be installed.",
                                       labels=["target", "reason", "rank", "node"])
        for (target, reason), count in sorted(snap.install_failures.items()):
            failures.add_metric([target, reason, rank, node], count)
        yield failures
        if snap.unresolved_checked:
            unresolved = GaugeMetricFamily(
                "memtel_hook_unresolved_targets",
                "1 for a configured hook target that is not resolved: not installed (its module was never "
                "imported, or it does not exist) or, by its preset, in none of the loaded model's layers; 0 once "
                "installed. Present after the model loaded (or the unresolved timer ran out).",
                labels=["target", "rank", "node"])
            for target, status in sorted(snap.targets.items()):
                unresolved.add_metric([target, rank, node], 0 if status == INSTALLED else 1)
            yield unresolved
        kind = getattr(self.reader(), "kind", None)
        if kind is not None:
            reader = GaugeMetricFamily("memtel_hook_allocator_reader_info",
                                       "1 for the way the hook reads the allocator: torch._C._cuda_memoryStats (the "
                                       "fast private binding), torch.cuda.memory_stats (the public fallback where "
                                       "torch lacks the binding) or allocator_source (set_allocator_source).",
                                       labels=["reader", "rank", "node"])
            reader.add_metric([kind, rank, node], 1)
            yield reader
        if snap.log_dropped is not None:
            dropped = CounterMetricFamily("memtel_hook_log_dropped_records",
                                          "Per-call log records that never reached the file: queue_full (the writer "
                                          "fell behind) or write_failed (a full disk, an I/O error).",
                                          labels=["reason", "rank", "node"])
            for reason, count in sorted(snap.log_dropped.items()):
                dropped.add_metric([reason, rank, node], count)
            yield dropped


__all__ = ["GROWTH_EVENTS_HELP", "HookCollector"]
