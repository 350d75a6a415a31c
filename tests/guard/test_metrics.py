"""The guard's own metrics: its counts, histograms and what the collector publishes."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from telemetry.catalogue import metrics as catalogue
from telemetry.guard.limit import LimitTracker
from telemetry.guard.metrics import ADDED_LATENCY_BUCKETS, GuardCollector, GuardMetrics, guard_registry
from telemetry.guard.proxy import GuardProxy
from telemetry.url import parse_base_url, parse_url
from tests.guard.servers import make_proxy


def test_a_guard_that_has_read_no_hook_yet_admits_blind_and_reports_no_fresh_rank():
    metrics = GuardMetrics()
    proxy = GuardProxy(parse_base_url("http://127.0.0.1:1"), LimitTracker([parse_url("http://127.0.0.1:2")],
                                                                          stale_s=5), metrics)
    assert proxy.when_blind == "admit"   # --when-blind's default
    registry = guard_registry(metrics, proxy.tracker, proxy.replicas)
    assert registry.get_sample_value("memtel_guard_fresh_ranks") == 0
    assert registry.get_sample_value("memtel_guard_hooks") == 1


def test_the_added_latency_histogram_counts_each_observation_in_its_bucket():
    metrics = GuardMetrics()
    metrics.observe_added(0.0003)
    metrics.observe_added(7.0)
    buckets, total = metrics.latency()
    assert len(buckets) == len(ADDED_LATENCY_BUCKETS) + 1
    assert buckets[ADDED_LATENCY_BUCKETS.index(0.0005)] == 1 and buckets[-1] == 1 and sum(buckets) == 2
    assert total == pytest.approx(7.0003)


def test_the_collector_describes_every_family_it_collects_so_a_registry_takes_it_once():
    proxy = make_proxy(2)
    collector = GuardCollector(proxy.metrics, proxy.tracker, proxy.replicas)
    described = {m.name for m in collector.describe()}
    assert {m.name for m in collector.collect()} <= described
    assert catalogue.GUARD_REPLICA_IN_POOL.new().name in described   # several replicas' families too
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.register(GuardCollector(proxy.metrics, proxy.tracker, proxy.replicas))
