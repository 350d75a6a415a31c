"""The hook's Prometheus metrics: fresh families from a snapshot of the state on every scrape.

Nothing is cached between scrapes (the way prometheus_client's custom collectors work). Series whose
source is absent are left out, never reported as 0: allocator series without an allocator, the
unresolved-targets gauge before the unresolved check ran, the log's dropped records without a log.
Names, types, labels and help come from the catalogue (telemetry/catalogue/metrics.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from telemetry.catalogue import metrics as catalogue
from telemetry.catalogue.fields import ALLOCATOR_FAMILIES
from telemetry.hook import allocator
from telemetry.hook.rank import resolve_rank
from telemetry.hook.state import INSTALLED, RESERVED_DELTA_BUCKETS, HookState

# The growth-event definition, used word for word in docs/hook.md and docs/architecture.md.
GROWTH_EVENTS_HELP = catalogue.HOOK_GROWTH_EVENTS.help

# Every family this collector can produce, in its order (describe() names them without collecting).
FAMILIES = (
    *(family for _, family in ALLOCATOR_FAMILIES), catalogue.HOOK_HOST_MEM_AVAILABLE, catalogue.HOOK_HOST_SWAP_FREE,
    catalogue.HOOK_CALLS, catalogue.HOOK_GROWTH_EVENTS, catalogue.HOOK_RESERVED_DELTA, catalogue.HOOK_ERRORS,
    catalogue.HOOK_INSTALL_FAILURES, catalogue.HOOK_UNRESOLVED_TARGETS, catalogue.HOOK_ALLOCATOR_READER_INFO,
    catalogue.HOOK_LOG_DROPPED_RECORDS,
)


class HookCollector(Collector):
    """Builds the hook's metric families from `state` (and which allocator reader is bound) on every scrape."""

    def __init__(self, state: HookState, reader: Callable[[], object] = allocator.current_reader) -> None:
        self.state = state
        self.reader = reader

    def describe(self) -> list[Metric]:
        """The families' names and types, from the catalogue: registering the collector must not collect (that
        would take the state's lock and resolve the rank inside the host process at install time)."""
        return [family.new() for family in FAMILIES]

    def collect(self) -> Iterator[Metric]:
        snap = self.state.snapshot()
        rank = str((snap.rank or resolve_rank()).rank)
        node = self.state.node
        counters = [(field, family.new()) for field, family in ALLOCATOR_FAMILIES]
        available = catalogue.HOOK_HOST_MEM_AVAILABLE.new()
        swap_free = catalogue.HOOK_HOST_SWAP_FREE.new()
        calls = catalogue.HOOK_CALLS.new()
        growth = catalogue.HOOK_GROWTH_EVENTS.new()
        delta = catalogue.HOOK_RESERVED_DELTA.new()
        for site, s in sorted(snap.sites.items()):
            values = [site, rank, node]
            calls.add_metric(values, s.calls)
            if s.allocator is not None:  # absent, not 0, without an allocator
                growth.add_metric(values, s.growth_events)
                for value, (_, family) in zip(s.allocator, counters, strict=True):
                    family.add_metric(values, value)
                cumulative, buckets = 0, []
                for bound, count in zip((*RESERVED_DELTA_BUCKETS, float("inf")), s.delta_buckets, strict=True):
                    cumulative += count
                    buckets.append(("+Inf" if bound == float("inf") else str(float(bound)), cumulative))
                delta.add_metric(values, buckets, s.delta_sum)
            if s.mem_available_bytes is not None:
                available.add_metric(values, s.mem_available_bytes)
            if s.swap_free_bytes is not None:
                swap_free.add_metric(values, s.swap_free_bytes)
        yield from (family for _, family in counters)
        yield from (available, swap_free, calls, growth, delta)

        errors = catalogue.HOOK_ERRORS.new()
        for (site, stage), count in sorted(snap.errors.items()):
            errors.add_metric([site, stage, rank, node], count)
        yield errors
        failures = catalogue.HOOK_INSTALL_FAILURES.new()
        for (target, reason), count in sorted(snap.install_failures.items()):
            failures.add_metric([target, reason, rank, node], count)
        yield failures
        if snap.unresolved_checked:
            unresolved = catalogue.HOOK_UNRESOLVED_TARGETS.new()
            for target, status in sorted(snap.targets.items()):
                unresolved.add_metric([target, rank, node], 0 if status == INSTALLED else 1)
            yield unresolved
        kind = getattr(self.reader(), "kind", None)
        if kind is not None:
            reader = catalogue.HOOK_ALLOCATOR_READER_INFO.new()
            reader.add_metric([kind, rank, node], 1)
            yield reader
        if snap.log_dropped is not None:
            dropped = catalogue.HOOK_LOG_DROPPED_RECORDS.new()
            for reason, count in sorted(snap.log_dropped.items()):
                dropped.add_metric([reason, rank, node], count)
            yield dropped


__all__ = ["FAMILIES", "GROWTH_EVENTS_HELP", "HookCollector"]
