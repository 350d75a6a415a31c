"""The live forecast's Prometheus metrics, built fresh from the forecaster's last results on every scrape.

Labels `rank` and `node` as every hook series (no `site`: the forecast is the process's allocator, not a
hooked function's); `tokens` for the forecast of each prefill length. The forecast series are absent while
there is no forecast (none yet, the last cycle failed, or nothing to forecast), never 0. Names are fixed in
docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from telemetry.catalogue.family import CounterFamily, GaugeFamily
from telemetry.catalogue.metrics import (
    FAMILIES,
    FORECAST_CPU,
    FORECAST_DEVICE_ALLOC,
    FORECAST_FAILURES,
    FORECAST_FIT_BUDGET,
    FORECAST_HELPER_CPU,
    FORECAST_LAST_DURATION,
    FORECAST_LAST_SUCCESS,
    FORECAST_MAX_PREFILL_TOKENS,
    FORECAST_MAX_PREFILL_TOKENS_AT_BEST,
    FORECAST_PEAK_RESERVED,
    FORECAST_RESERVED_GROWTH,
    FORECAST_SNAPSHOT_READER_INFO,
    FORECAST_SNAPSHOT_RESYNCS,
    FORECAST_WORKLOAD_INFO,
)
from telemetry.hook.forecast.runner import Forecaster
from telemetry.hook.rank import resolve_rank
from telemetry.hook.state import HookState

# (Forecast field, family)
_FORECAST_GAUGES = (
    ("reserved_growth_bytes", FORECAST_RESERVED_GROWTH),
    ("peak_reserved_bytes", FORECAST_PEAK_RESERVED),
    ("num_device_alloc", FORECAST_DEVICE_ALLOC),
)


class ForecastCollector(Collector):
    """Builds the forecast's families from `forecaster.results` on every scrape."""

    def __init__(self, forecaster: Forecaster, state: HookState) -> None:
        self.forecaster = forecaster
        self.state = state

    def describe(self) -> list[Metric]:
        """The catalogue's forecast families: registering the collector must not collect (that would read the
        forecaster's results and resolve the rank inside the host process at install time)."""
        return [family.new() for family in FAMILIES.values() if family.source == "forecast"]

    def collect(self) -> Iterator[Metric]:
        results = self.forecaster.results
        rank = str((self.state.rank or resolve_rank()).rank)
        node = self.state.node
        for field, entry in _FORECAST_GAUGES:
            family = entry.new()
            for f in results.forecasts:
                family.add_metric([str(f.tokens), rank, node], getattr(f, field))
            yield family
        if results.workload is not None:
            info = results.workload.info_labels()
            workload = FORECAST_WORKLOAD_INFO.new(labels=[*info, "rank", "node"])
            workload.add_metric([*info.values(), rank, node], 1)
            yield workload
        if results.max_fit is not None and results.budget is not None:
            yield _one(FORECAST_MAX_PREFILL_TOKENS, results.max_fit.tokens, rank, node)
            yield _one(FORECAST_FIT_BUDGET, results.budget.budget_bytes, rank, node)
            if results.at_best is not None:
                yield _one(FORECAST_MAX_PREFILL_TOKENS_AT_BEST, results.at_best.tokens, rank, node)
        if results.last_duration_s is not None:
            yield _one(FORECAST_LAST_DURATION, results.last_duration_s, rank, node)
        if results.last_success_s is not None:
            yield _one(FORECAST_LAST_SUCCESS, results.last_success_s, rank, node)
        yield _one(FORECAST_CPU, results.cpu_seconds, rank, node)
        yield _one(FORECAST_HELPER_CPU, results.helper_cpu_seconds, rank, node)
        if results.snapshot_reader is not None:
            reader = FORECAST_SNAPSHOT_READER_INFO.new()
            reader.add_metric([results.snapshot_reader, rank, node], 1)
            yield reader
        if results.resyncs:
            yield _by_reason(FORECAST_SNAPSHOT_RESYNCS, results.resyncs, rank, node)
        yield _by_reason(FORECAST_FAILURES, results.failures, rank, node)


def _one(entry: GaugeFamily | CounterFamily, value: float, rank: str, node: str) -> Metric:
    family = entry.new()
    family.add_metric([rank, node], value)
    return family


def _by_reason(entry: CounterFamily, counts: Mapping[str, int], rank: str, node: str) -> Metric:
    family = entry.new()
    for reason, count in sorted(counts.items()):
        family.add_metric([reason, rank, node], count)
    return family


__all__ = ["ForecastCollector"]
