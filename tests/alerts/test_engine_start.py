"""The hook says what an engine's start will still take (memtel_engine_start_remaining_bytes, issue 29): from the
worker's budget (vLLM's requested_memory) when init_device returns until warm-up returns; and the daemon's protect
action reads it from the hook exporters' last values."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
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


# -- SGLang's start (issue 38): its budget is known before its weights load, as vLLM's is ----------------------
def test_sglangs_plan_is_mem_fraction_static_of_the_memory_available_before_its_weights():
    runner = SimpleNamespace(pre_model_load_memory=113.0, mem_fraction_static=0.85)
    assert start_plan_bytes(runner, None) == int(113.0 * 0.85 * GIB)
    assert start_plan_bytes(runner, 7 * GIB) == int(113.0 * 0.85 * GIB)   # the plan is the budget, not on top
    for bad in (dict(pre_model_load_memory=113.0), dict(mem_fraction_static=0.85),
                dict(pre_model_load_memory=113.0, mem_fraction_static=1.5),
                dict(pre_model_load_memory=float("nan"), mem_fraction_static=0.85),
                dict(pre_model_load_memory=True, mem_fraction_static=0.85),
                dict(pre_model_load_memory=-1.0, mem_fraction_static=0.85)):
        assert start_plan_bytes(SimpleNamespace(**bad), None) is None, bad


def test_sglangs_start_is_exported_from_init_torch_distributed_until_initialize_returns():
    runner = SimpleNamespace(pre_model_load_memory=100.0, mem_fraction_static=0.8)
    tracker = EngineTracker()
    tracker.engine_signal(runner, "ModelRunner.init_torch_distributed")
    held = remaining(tracker)
    assert held is not None and 0 < 80 * GIB - held < 8 * GIB   # its resident set counts (no CUDA here)
    tracker.engine_signal(runner, "ModelRunner.initialize")
    assert remaining(tracker) is None


def test_memtel_run_watches_sglangs_start():
    from telemetry.engines.sglang import START_BEGIN
    from telemetry.run.boot import config_from_env as run_config

    assert START_BEGIN_SIGNALS["sglang"] == (START_BEGIN,)
    config = run_config({"MEMTEL_TARGETS": "sglang-sparse-indexer"})
    assert config is not None and START_BEGIN in config.engine_memory


@pytest.mark.network
def test_sglangs_source_sets_the_plan_before_the_weights_load():
    """Against sglang 0.5.23's own source (its wheel, tests/support/sglang_source.py): ModelRunner.__init__ keeps
    mem_fraction_static and calls init_torch_distributed, which stores pre_model_load_memory, before initialize
    (which loads the weights); the KV pool leaves pre_model_load_memory * (1 - mem_fraction_static) free."""
    import ast

    from tests.support import sglang_source

    runner = next(node for node in ast.walk(sglang_source.tree("sglang.srt.model_executor.model_runner"))
                  if isinstance(node, ast.ClassDef) and node.name == "ModelRunner")
    methods = {node.name: node for node in runner.body if isinstance(node, ast.FunctionDef)}

    def assigned(function: ast.FunctionDef) -> set[str]:
        return {target.attr for node in ast.walk(function) if isinstance(node, ast.Assign)
                for target in node.targets if isinstance(target, ast.Attribute)}

    def calls(function: ast.FunctionDef) -> list[str]:
        return [node.func.attr for node in ast.walk(function) if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "self"]

    assert "mem_fraction_static" in assigned(methods["__init__"])
    assert "pre_model_load_memory" in assigned(methods["init_torch_distributed"])
    order = calls(methods["__init__"])
    assert order.index("init_torch_distributed") < order.index("initialize")
    configurator = sglang_source.source("sglang.srt.mem_cache.kv_cache_configurator")
    assert "pre_model_load_memory * (1 - get_schedule().mem_fraction_static)" in configurator
