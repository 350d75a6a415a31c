"""The hook's collectors describe themselves from the catalogue: registering them in a registry with
`auto_describe=True` (what the hook's exporter uses) must not collect, which would take the hook state's
lock and resolve the rank inside the host process at install time."""

from __future__ import annotations

import types

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import telemetry.hook.collector as hook_collector
import telemetry.hook.forecast.collector as forecast_collector
from telemetry.catalogue import FAMILIES
from telemetry.hook.collector import FAMILIES as HOOK_FAMILIES
from telemetry.hook.collector import HookCollector
from telemetry.hook.forecast.collector import ForecastCollector
from telemetry.hook.state import HookState
from tests.hook.test_golden_metrics import golden_exporter  # noqa: F401  (a fixture: the hook's real exporter)


@pytest.fixture
def no_rank(monkeypatch):
    """Resolving the rank fails the test: registration must not get there."""
    calls: list[str] = []

    def resolve_rank():
        calls.append("resolve_rank")
        raise AssertionError("the rank was resolved at registration")

    monkeypatch.setattr(hook_collector, "resolve_rank", resolve_rank)
    monkeypatch.setattr(forecast_collector, "resolve_rank", resolve_rank)
    return calls


class _Untouchable(HookState):
    def snapshot(self):  # type: ignore[override]
        raise AssertionError("the hook state was read (its lock taken) at registration")


def test_registering_the_hook_collector_does_not_collect(no_rank):
    collector = HookCollector(_Untouchable(node="n", targets={}))
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    assert no_rank == []
    names = registry._collector_to_names[collector]  # what the registry reserved for duplicate checks
    assert {family.series for family in HOOK_FAMILIES} <= set(names)


def test_registering_the_forecast_collector_does_not_collect(no_rank):
    class Forecaster:
        @property
        def results(self):
            raise AssertionError("the forecaster's results were read at registration")

    collector = ForecastCollector(Forecaster(), _Untouchable(node="n", targets={}))  # type: ignore[arg-type]
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    assert no_rank == []
    described = {family.name for family in collector.describe()}
    assert described == {f.name for f in FAMILIES.values() if f.source == "forecast"}


def test_describe_names_every_family_the_hook_exports(golden_exporter):  # noqa: F811
    """The golden run exports every hook family; describe() names exactly those, with the same types."""
    text = httpx.get(golden_exporter, timeout=5).text
    exported = {(f.name, f.type) for f in text_string_to_metric_families(text) if f.name.startswith("memtel_hook_")
                or f.name.startswith("memtel_allocator_")}
    described = {(f.name, f.type) for f in HookCollector(HookState(node="n", targets={})).describe()}
    assert exported == described


def test_the_forecast_collector_yields_only_described_families():
    from telemetry.allocator_counters import AllocatorCounters
    from telemetry.hook.forecast.runner import ForecastResults
    from telemetry.hook.forecast.workload import make_workload
    from telemetry.model.indexer.forecast import Forecast
    from telemetry.model.indexer.shape import REFERENCE_SHAPE

    forecast = Forecast(tokens=1000, mode="stock", alloc_conf="", start=AllocatorCounters(0, 0, 0, 0),
                        reserved_growth_bytes=1, peak_reserved_bytes=2, peak_growth_bytes=2, num_device_alloc=1,
                        num_device_free=0)
    results = ForecastResults(workload=make_workload(REFERENCE_SHAPE, source="reference"), forecasts=(forecast,),
                              last_duration_s=0.1, last_success_s=1.0e9, failures={"snapshot": 1}, cpu_seconds=0.5)
    collector = ForecastCollector(types.SimpleNamespace(results=results),  # type: ignore[arg-type]
                                  HookState(node="n", targets={}))
    collected = {f.name for f in collector.collect()}
    assert collected <= {f.name for f in collector.describe()}
