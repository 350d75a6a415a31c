"""The live forecast's Prometheus metrics, built fresh from the forecaster's last results on every scrape.

Labels `rank` and `node` as every hook series (no `site`: the forecast is the process's allocator, not a
hooked function's); `tokens` for the forecast of each prefill length. The forecast series are absent while
there is no forecast (none yet, the last cycle failed, or nothing to forecast), never 0. Names are fixed in
docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from telemetry.catalogue.metrics import (
    FAMILIES,
    FORECAST_FIT_BUDGET,
    FORECAST_HELPER_CPU,
    FORECAST_MAX_PREFILL_TOKENS,
    FORECAST_SNAPSHOT_READER_INFO,
    FORECAST_SNAPSHOT_RESYNCS,
)
from telemetry.hook.forecast.runner import Forecaster
from telemetry.hook.rank import resolve_rank
from telemetry.hook.state import HookState

# (Forecast field, metric, help)
_FORECAST_GAUGES = (
    ("reserved_growth_bytes", "memtel_forecast_reserved_growth_bytes",
     "Bytes the caching allocator would add to its reserved bytes during the next prefill of `tokens` tokens, "
     "forecast by simulating the allocator from its live state (what stays reserved after the prefill)."),
    ("peak_reserved_bytes", "memtel_forecast_peak_reserved_bytes",
     "The allocator's highest reserved bytes during the next prefill of `tokens` tokens, forecast from its live "
     "state (absolute, as memtel_allocator_reserved_bytes counts)."),
    ("num_device_alloc", "memtel_forecast_device_alloc",
     "Device allocs (num_device_alloc: cudaMalloc calls, or map calls under expandable segments) the allocator "
     "would make during the next prefill of `tokens` tokens, forecast from its live state."),
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
        for name, metric, help_text in _FORECAST_GAUGES:
            family = GaugeMetricFamily(metric, help_text, labels=["tokens", "rank", "node"])
            for f in results.forecasts:
                family.add_metric([str(f.tokens), rank, node], getattr(f, name))
            yield family
        if results.workload is not None:
            info = results.workload.info_labels()
            workload = GaugeMetricFamily(
                "memtel_forecast_workload_info",
                "1 for the indexer workload the live forecast simulates; `source`: vllm (read from vLLM's config), "
                "program (set_forecast_workload), config (MEMTEL_FORECAST_SHAPE) or reference (the reference "
                "workload).", labels=[*info, "rank", "node"])
            workload.add_metric([*info.values(), rank, node], 1)
            yield workload
        if results.max_fit is not None and results.budget is not None:
            for entry, value in ((FORECAST_MAX_PREFILL_TOKENS, results.max_fit.tokens),
                                 (FORECAST_FIT_BUDGET, results.budget.budget_bytes)):
                fit = entry.new()
                fit.add_metric([rank, node], value)
                yield fit
        if results.last_duration_s is not None:
            yield _one("memtel_forecast_last_duration_seconds",
                       "Wall time of the live forecast's last cycle: the allocator snapshot, reading it and simulating "
                       "every prefill length (only the snapshot when nothing changed since the cycle before).",
                       results.last_duration_s, rank, node)
        if results.last_success_s is not None:
            yield _one("memtel_forecast_last_success_timestamp_seconds",
                       "Unix time of the allocator snapshot that the live forecast's last successful cycle started "
                       "from: the forecast is the allocator's as of then.", results.last_success_s, rank, node)
        cpu = CounterMetricFamily("memtel_forecast_cpu_seconds",
                                  "CPU time the live forecast's cycles have taken in this process (the cost of its "
                                  "thread).", labels=["rank", "node"])
        cpu.add_metric([rank, node], results.cpu_seconds)
        yield cpu
        helper_cpu = FORECAST_HELPER_CPU.new()
        helper_cpu.add_metric([rank, node], results.helper_cpu_seconds)
        yield helper_cpu
        if results.snapshot_reader is not None:
            reader = FORECAST_SNAPSHOT_READER_INFO.new()
            reader.add_metric([results.snapshot_reader, rank, node], 1)
            yield reader
        if results.resyncs:
            resyncs = FORECAST_SNAPSHOT_RESYNCS.new()
            for reason, count in sorted(results.resyncs.items()):
                resyncs.add_metric([reason, rank, node], count)
            yield resyncs
        failures = CounterMetricFamily("memtel_forecast_failures",
                                       "Live forecast cycles that failed, by reason: snapshot (taking or reading the "
                                       "allocator snapshot), unsupported_state (the snapshot holds what the simulator "
                                       "does not model), settings (allocator settings it cannot simulate), "
                                       "simulation (any other error, or the helper process failing), budget (the "
                                       "fit budget could not be read), unavailable (the forecast cannot run in this "
                                       "process: no CUDA device).", labels=["reason", "rank", "node"])
        for reason, count in sorted(results.failures.items()):
            failures.add_metric([reason, rank, node], count)
        yield failures


def _one(name: str, help_text: str, value: float, rank: str, node: str) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text, labels=["rank", "node"])
    family.add_metric([rank, node], value)
    return family


__all__ = ["ForecastCollector"]
