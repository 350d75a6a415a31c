"""The hook says what an engine's start will still take (memtel_engine_start_remaining_bytes, issue 29): from the
worker's budget (vLLM's requested_memory) when init_device returns until warm-up returns; and the daemon's protect
action reads it from the hook exporters' last values."""

from __future__ import annotations

import os
from types import SimpleNamespace

from prometheus_client.registry import CollectorRegistry

from telemetry.catalogue.metrics import ENGINE_START_REMAINING
from telemetry.daemon.protect import start_remaining_bytes
from telemetry.flight.hooks import hook_series
from telemetry.hook.engine import START_BEGIN_SIGNALS, EngineCollector, EngineTracker, start_plan_bytes
from telemetry.hook.state import HookState
from telemetry.vllm_plugin import config_from_env

GIB = 1 << 30


def remaining(tracker: EngineTracker) -> float | None:
    registry = CollectorRegistry()
    registry.register(EngineCollector(tracker, HookState(node="spark-a", targets={})))
    labels = {"rank": "0", "node": "spark-a", "pid": str(os.getpid())}
    return registry.get_sample_value(ENGINE_START_REMAINING.series, labels)


def test_the_start_is_exported_from_init_device_until_warm_up_returns():
    worker = SimpleNamespace(requested_memory=102 * GIB, cache_config=SimpleNamespace(kv_cache_memory_bytes=None))
    tracker = EngineTracker()
    assert remaining(tracker) is None  # no start seen: no series
    tracker.engine_signal(worker, "Worker.init_device")
    held = remaining(tracker)
    # Without CUDA the process's resident set is what it holds (as vLLM's CPU worker counts it).
    assert held is not None and 0 < 102 * GIB - held < 8 * GIB
    tracker.engine_signal(worker, "Worker.initialize_from_config")  # the KV cache: still starting
    assert remaining(tracker) is not None
    tracker.engine_signal(worker, "CPUWorker.compile_or_warm_up_model")
    assert remaining(tracker) is None


def test_the_plan_is_the_workers_budget_or_what_it_holds_plus_an_explicit_kv_cache():
    assert start_plan_bytes(SimpleNamespace(requested_memory=10 * GIB), None) == 10 * GIB
    assert start_plan_bytes(SimpleNamespace(requested_cpu_memory=3 * GIB), 1) == 3 * GIB
    explicit = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_memory_bytes=4 * GIB), requested_memory=GIB)
    assert start_plan_bytes(explicit, 2 * GIB) == 6 * GIB
    assert start_plan_bytes(explicit, None) is None  # weights not loaded yet: the plan is not known
    assert start_plan_bytes(SimpleNamespace(), 5) is None
    assert start_plan_bytes(SimpleNamespace(requested_memory=True), 5) is None


def test_the_vllm_plugin_watches_the_start_from_init_device():
    config = config_from_env({"MEMTEL_TARGETS": "vllm-sparse-indexer"})
    assert config is not None
    assert set(START_BEGIN_SIGNALS["vllm"]) <= set(config.engine_memory)


def test_protect_reads_the_starts_of_the_hook_exporters():
    text = ("# TYPE memtel_engine_start_remaining_bytes gauge\n"
            'memtel_engine_start_remaining_bytes{rank="0",node="a",pid="7"} 3e9\n'
            "# TYPE memtel_engine_resident_bytes gauge\n"
            'memtel_engine_resident_bytes{rank="0",node="a",pid="7"} 1e9\n')
    values = hook_series(text, "127.0.0.1:9200") | hook_series(text.replace('pid="7"', 'pid="8"'), "127.0.0.1:9201")
    starts = start_remaining_bytes(values)
    assert sorted(starts.values()) == [3e9, 3e9] and all('pid="7"' in k or 'pid="8"' in k for k in starts)
    serving = "# TYPE memtel_engine_resident_bytes gauge\n" + 'memtel_engine_resident_bytes{pid="7"} 1e9\n'
    assert start_remaining_bytes(hook_series(serving, "127.0.0.1:9200")) == {}


def test_a_real_vllm_start_recorded_by_the_flight_recorder_says_where_the_node_ends():
    """The corpus's live recording (tests/alerts/record_vllm_start.py: vLLM CPU with the plugin, the daemon's flight
    recorder scraping its hook): while the start ran, the headroom less what it said it would still take was within
    1 GiB of where the headroom settled."""
    from telemetry.alerts.timeline import load_timeline
    from tests.alerts.make_corpus import CORPUS

    timeline = load_timeline(CORPUS / "vllm-cpu-start-live.jsonl.gz")
    headroom = "memtel_node_unified_headroom_bytes"
    during = [(r.values[headroom], sum(start_remaining_bytes(r.values).values())) for r in timeline.records
              if start_remaining_bytes(r.values)]
    assert len(during) >= 3 and during[0][1] > 2 * GIB  # the start was seen before most of its KV cache was taken
    settled = timeline.records[-20].values[headroom]  # served for 20 s after it was healthy
    assert all(abs(h - remaining - settled) < GIB for h, remaining in during), (during, settled)
