"""The hook's live forecast on the simulator source: settings, exactness, failures, the thread's life.

The allocator here is the caching-allocator simulator behind `set_allocator_source(..., snapshot=...)`, as in
the lab server; the CUDA path is tests/hook/test_forecast_gpu.py. Exactness: the simulator is exact, so the
forecast made before a prefill must equal, byte for byte, what that prefill then adds to the same simulator.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

import telemetry
from telemetry.errors import ConfigError
from telemetry.hook import set_allocator_source
from telemetry.hook.config import HookConfig
from telemetry.hook.forecast import set_forecast_workload
from telemetry.hook.forecast.settings import MAX_FORECAST_LENGTHS, MAX_FORECAST_TOKENS, check_interval, check_tokens
from telemetry.hook.forecast.workload import CONFIG, PROGRAM, REFERENCE, process_alloc_conf, workload_from_text
from telemetry.model.allocsim.snapshot import read_allocator_state
from telemetry.model.indexer.backends import SimBackend
from telemetry.model.indexer.forecast import forecast
from telemetry.model.indexer.prefill import LaunchPattern, run_prefill
from telemetry.model.indexer.shape import MIB, REFERENCE_SHAPE, IndexerShape

ROOT = Path(__file__).resolve().parents[2]
NODE = socket.gethostname()
SHAPE = IndexerShape(layers=4, chunk=1024, max_model_len=65536, logits_budget_bytes=64 * MIB)
PATTERN = LaunchPattern(row_scale=0.5)


@pytest.fixture(autouse=True)
def _no_program_workload():
    yield
    set_forecast_workload(None)


def rank_labels(**extra):
    return {"rank": "0", "node": NODE, **extra}


# ---- settings ------------------------------------------------------------------------------------


def test_token_lists_are_checked_sorted_and_deduplicated():
    assert check_tokens("200000, 100000,100_000") == (100000, 200000)
    assert check_tokens([5, 3]) == (3, 5) and check_tokens(None) == () and check_tokens("") == ()
    for bad, says in [("abc", "'abc' is not a token count"), ("0", "out of range"), ("-5", "not a token count"),
                      (f"{MAX_FORECAST_TOKENS + 1}", "out of range"), ("１２", "not a token count"),
                      (",".join(str(n) for n in range(1, MAX_FORECAST_LENGTHS + 2)), "lengths"),
                      ([True], "not a token count"), ("1e5", "not a token count")]:
        with pytest.raises(ConfigError, match=says) as caught:
            check_tokens(bad, "MEMTEL_FORECAST_TOKENS")
        assert "MEMTEL_FORECAST_TOKENS" in str(caught.value) and "expected" in str(caught.value)


def test_the_interval_is_bounded():
    assert check_interval("2.5") == 2.5 and check_interval(60) == 60.0
    for bad in ("0", "0.5", "3601", "nan", "inf", "soon", True):
        with pytest.raises(ConfigError, match="seconds"):
            check_interval(bad, "MEMTEL_FORECAST_INTERVAL_S")


def test_a_shape_text_overrides_the_reference_workload_key_by_key():
    workload = workload_from_text("layers=61, chunk=8192, budget_mb=96.5, mode=fixed, max-model-len=163840")
    assert workload.source == CONFIG and workload.mode == "fixed"
    assert workload.shape == IndexerShape(layers=61, chunk=8192, compress_ratio=REFERENCE_SHAPE.compress_ratio,
                                          max_model_len=163840, logits_budget_bytes=int(96.5 * MIB))
    for bad, says in [("layerz=3", "unknown key 'layerz'; valid keys: layers, chunk"), ("layers", "not key=value"),
                      ("layers=0", "layers must be a positive integer"), ("budget_mb=lots", "budget_mb='lots'"),
                      ("mode=wide", "width mode must be one of stock, fixed"), ("chunk=1,chunk=2", "given twice"),
                      ("topk=-1", "not a non-negative integer"), (",", "expected key=value pairs")]:
        with pytest.raises(ConfigError, match=says):
            workload_from_text(bad)


def test_bad_forecast_variables_turn_off_the_forecast_only_with_one_line(caplog):
    base = {"MEMTEL_TARGETS": "json:loads", "MEMTEL_PORT": "9321", "MEMTEL_FORECAST_TOKENS": "100000"}
    good = HookConfig.from_env(base)
    assert good is not None and good.forecast_tokens == (100000,) and good.forecast_interval_s == 5.0
    for variable, value in [("MEMTEL_FORECAST_TOKENS", "100k"), ("MEMTEL_FORECAST_INTERVAL_S", "0"),
                            ("MEMTEL_FORECAST_SHAPE", "layers=many")]:
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="memtel"):
            config = HookConfig.from_env({**base, variable: value})
        assert config is not None and config.port == 9321 and config.targets == ("json:loads",)
        assert config.forecast_tokens == (), variable
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and variable in lines[0] and "the live forecast is off" in lines[0], lines
    with pytest.raises(ConfigError, match="MEMTEL_PORT"):   # other settings still stop the hook as before
        HookConfig.from_env({**base, "MEMTEL_PORT": "port"})


def test_install_refuses_bad_forecast_options():
    for options, says in [({"forecast_tokens": "many"}, "not a token count"), ({"forecast_interval_s": 0.01}, "range"),
                          ({"forecast_shape": "chunk=0"}, "chunk must be a positive integer"),
                          ({"forecast_shape": 42}, "forecast_shape must be")]:
        with pytest.raises(ConfigError, match=says):
            telemetry.install(["json:loads"], port=None, **{"forecast_tokens": "1000", **options})


def test_the_process_allocator_settings_follow_torchs_precedence():
    assert process_alloc_conf({}) == ""
    assert process_alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) == "expandable_segments:True"
    assert process_alloc_conf({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64",
                               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) == "max_split_size_mb:64"


# ---- the forecast, live ---------------------------------------------------------------------------


TARGET = "telemetry.model.indexer.launch:indexer_logits_launch"   # the lab-indexer preset's target


@pytest.fixture
def lab_rank():
    """A lab-server rank in miniature: a simulator backend whose launches go through the hooked launch."""
    backend = SimBackend("")
    calls = []

    def snapshot():
        calls.append(threading.current_thread().name)
        return backend.snapshot()   # under the backend's lock, as CUDA's under the allocator's

    set_allocator_source(backend.counters, snapshot=snapshot)
    set_forecast_workload(SHAPE, mode="stock", pattern=PATTERN, alloc_conf="")
    return backend, TARGET, calls


def started(target: str, registry: CollectorRegistry, tokens=(3000, 20000), **options):
    handle = telemetry.install([target], port=None, registry=registry, forecast_tokens=tokens,
                               forecast_interval_s=3600, **options)
    return handle


def wait_for(predicate, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_exported_forecast_is_what_the_next_prefill_adds_exactly(lab_rank):
    backend, target, snapshot_threads = lab_rank
    registry = CollectorRegistry()
    handle = started(target, registry)
    forecaster = handle.forecaster
    assert forecaster is not None
    get = lambda name, **labels: registry.get_sample_value(name, rank_labels(**labels))
    assert get("memtel_forecast_reserved_growth_bytes", tokens="3000") is None   # nothing before an allocator
    run_prefill(backend, SHAPE, "stock", 1, pattern=PATTERN)   # the first hooked call starts the process (and thread)
    wait_for(lambda: forecaster.results.forecasts, what="the thread's first forecast")
    assert set(snapshot_threads) == {"memtel-forecast"}, "the snapshot is taken by the forecast thread only"
    calls = registry.get_sample_value("memtel_hook_calls_total", rank_labels(site=target))
    for tokens in (3000, 20000):
        if tokens != 3000:
            assert forecaster.run_once()
        expected = {n: forecast(read_allocator_state(backend.snapshot()), SHAPE, n, pattern=PATTERN,
                                alloc_conf="") for n in (3000, 20000)}
        for n, f in expected.items():
            assert get("memtel_forecast_reserved_growth_bytes", tokens=str(n)) == f.reserved_growth_bytes
            assert get("memtel_forecast_peak_reserved_bytes", tokens=str(n)) == f.peak_reserved_bytes
            assert get("memtel_forecast_device_alloc", tokens=str(n)) == f.num_device_alloc
        before = backend.counters()
        peak = before.reserved_bytes
        run_prefill(backend, SHAPE, "stock", tokens, pattern=PATTERN)
        after = backend.counters()
        growth = after.reserved_bytes - before.reserved_bytes
        assert growth == get("memtel_forecast_reserved_growth_bytes", tokens=str(tokens)) > 0
        assert after.num_device_alloc - before.num_device_alloc == get("memtel_forecast_device_alloc",
                                                                         tokens=str(tokens))
        assert peak <= get("memtel_forecast_peak_reserved_bytes", tokens=str(tokens))
    # The forecast never ran the hooked function: only the prefills' launches were recorded.
    launches = registry.get_sample_value("memtel_hook_calls_total", rank_labels(site=target)) - calls
    assert launches == SHAPE.layers * (3 + 20)   # 3 and 20 chunk steps, one launch per layer each
    assert get("memtel_forecast_workload_info", source=PROGRAM, mode="stock", layers="4", chunk="1024",
               compress_ratio="4", max_model_len="65536", logits_budget_bytes=str(64 * MIB), padded_width="16384",
               topk="0") == 1
    assert get("memtel_forecast_last_success_timestamp_seconds") == pytest.approx(time.time(), abs=30)
    assert 0 < get("memtel_forecast_last_duration_seconds") < 30
    handle.uninstall()


def test_promtool_finds_no_problems_in_the_forecast_metrics(lab_rank):
    backend, target, _ = lab_rank
    registry = CollectorRegistry()
    handle = started(target, registry)
    run_prefill(backend, SHAPE, "stock", 1, pattern=PATTERN)
    wait_for(lambda: handle.forecaster.results.forecasts, what="the first forecast")
    handle.forecaster.reader().snapshot_source = lambda: 1 / 0
    handle.forecaster.run_once()   # a failure series too
    set_forecast_workload(SHAPE, pattern=PATTERN)
    text = generate_latest(registry).decode()
    assert "memtel_forecast_failures_total{" in text and "memtel_forecast_workload_info{" in text
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: apt-get install -y prometheus (scripts/test does it)"
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert [line for line in (result.stdout + result.stderr).splitlines() if line.strip()] == []
    handle.uninstall()


def test_an_unchanged_allocator_is_not_simulated_again(lab_rank, monkeypatch):
    backend, target, _ = lab_rank
    registry = CollectorRegistry()
    handle = started(target, registry)
    run_prefill(backend, SHAPE, "stock", 1, pattern=PATTERN)
    forecaster = handle.forecaster
    wait_for(lambda: forecaster.results.forecasts, what="the first forecast")
    first = forecaster.results
    simulated = []
    helper = forecaster._helper   # the simulation runs in the helper process: count what it is asked
    assert helper is not None
    real = helper.cycle
    monkeypatch.setattr(helper, "cycle", lambda request, *a: simulated.append(request) or real(request, *a))
    assert forecaster.run_once() and not simulated
    assert forecaster.results.forecasts == first.forecasts and forecaster.results.last_success_s >= first.last_success_s
    backend.alloc(3 * MIB)   # a live block: the state changed
    assert forecaster.run_once() and len(simulated) == 1 and simulated[0]["tokens"] == list(forecaster.tokens)
    handle.uninstall()


def test_failures_are_counted_by_reason_logged_once_a_minute_and_leave_the_forecast_out(lab_rank, caplog):
    backend, target, _ = lab_rank
    backend.alloc(5 * MIB)   # one segment with a live block
    registry = CollectorRegistry()
    handle = started(target, registry)
    run_prefill(backend, SHAPE, "stock", 1, pattern=PATTERN)
    forecaster = handle.forecaster
    wait_for(lambda: forecaster.results.forecasts, what="the first forecast")
    reader = forecaster.reader()
    good = reader.snapshot_source
    get = lambda name, **labels: registry.get_sample_value(name, rank_labels(**labels))
    caplog.set_level(logging.WARNING, logger="memtel")

    def broken():
        raise RuntimeError("simulator busy")

    reader.snapshot_source = broken
    for _ in range(3):
        assert not forecaster.run_once()
    assert get("memtel_forecast_failures_total", reason="snapshot") == 3
    assert get("memtel_forecast_reserved_growth_bytes", tokens="3000") is None   # left out, not stale, not 0
    assert get("memtel_forecast_last_success_timestamp_seconds") is not None      # the last success stays known
    lines = [r.getMessage() for r in caplog.records if "live forecast failed" in r.getMessage()]
    assert len(lines) == 1 and "(snapshot): simulator busy" in lines[0], lines

    def unknown_state():
        segments = good()
        segments[0]["blocks"][0]["state"] = "haunted"
        return segments

    reader.snapshot_source = unknown_state
    assert not forecaster.run_once(), forecaster.results
    assert get("memtel_forecast_failures_total", reason="unsupported_state") == 1, forecaster.results.failures
    reader.snapshot_source = good
    set_forecast_workload(SHAPE, pattern=PATTERN)   # settings from the environment now
    forecaster.environ = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}   # not the caching allocator
    assert not forecaster.run_once()
    assert get("memtel_forecast_failures_total", reason="settings") == 1
    forecaster.environ = {}
    assert forecaster.run_once() and get("memtel_forecast_reserved_growth_bytes", tokens="3000") is not None
    # The hooked call never noticed: it still records.
    calls = get("memtel_hook_calls_total", site=target)
    run_prefill(backend, SHAPE, "stock", 1, pattern=PATTERN)
    assert get("memtel_hook_calls_total", site=target) == calls + SHAPE.layers
    handle.uninstall()


def test_a_source_without_a_snapshot_is_said_once_and_counts_no_failure(lab_rank, caplog):
    backend, target, _ = lab_rank
    set_allocator_source(backend.counters)   # counters only: nothing to forecast from
    registry = CollectorRegistry()
    caplog.set_level(logging.WARNING, logger="memtel")
    handle = started(target, registry)
    run_prefill(backend, SHAPE, "stock", 1, pattern=PATTERN)
    forecaster = handle.forecaster
    wait_for(lambda: forecaster.results.cpu_seconds > 0, what="the first cycle")
    assert not forecaster.run_once() and not forecaster.results.forecasts
    lines = [r.getMessage() for r in caplog.records if "gives no snapshot" in r.getMessage()]
    assert len(lines) == 1, lines
    assert forecaster.results.failures == {}
    handle.uninstall()


def test_uninstall_stops_the_thread(lab_rank):
    backend, target, _ = lab_rank
    handle = started(target, CollectorRegistry())
    run_prefill(backend, SHAPE, "stock", 1, pattern=PATTERN)
    forecaster = handle.forecaster
    wait_for(lambda: forecaster.running and forecaster.results.last_duration_s is not None, what="the thread")
    thread = next(t for t in threading.enumerate() if t.name == "memtel-forecast")
    assert thread.daemon
    handle.uninstall()
    assert not thread.is_alive() and not forecaster.running


def test_without_tokens_there_is_no_forecast_and_no_thread(lab_rank):
    backend, target, _ = lab_rank
    registry = CollectorRegistry()
    handle = telemetry.install([target], port=None, registry=registry)
    run_prefill(backend, SHAPE, "stock", 1, pattern=PATTERN)
    assert handle.forecaster is None
    assert not [t for t in threading.enumerate() if t.name == "memtel-forecast"]
    assert not [m for m in registry.collect() if m.name.startswith("memtel_forecast")]
    handle.uninstall()


# ---- where the workload comes from ------------------------------------------------------------------


def test_the_workload_is_the_programs_then_the_configs_then_the_reference(lab_rank, caplog):
    backend, target, _ = lab_rank
    set_forecast_workload(None)
    registry = CollectorRegistry()
    caplog.set_level(logging.INFO, logger="memtel")
    handle = started(target, registry, tokens=(3000,), forecast_shape="layers=2,chunk=2048,mode=fixed,budget_mb=8")
    run_prefill(backend, SHAPE, "stock", 1, pattern=PATTERN)
    forecaster = handle.forecaster
    wait_for(lambda: forecaster.results.forecasts, what="the first forecast")
    workload = forecaster.results.workload
    assert workload.source == CONFIG and workload.mode == "fixed" and workload.shape.layers == 2
    announcement = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memtel hook on"))
    assert "forecast: 3,000 tokens every 3600 s, 2 indexer layers, 2,048-token chunks" in announcement
    assert "fixed width" in announcement and "MEMTEL_FORECAST_SHAPE" in announcement
    set_forecast_workload(SHAPE, pattern=PATTERN)
    assert forecaster.workload().source == PROGRAM
    handle.uninstall()
    plain = HookConfig(targets=[target], port=None, forecast_tokens=(3000,))
    from telemetry.hook.forecast.runner import Forecaster

    set_forecast_workload(None)
    reference = Forecaster(plain.forecast_tokens, plain.forecast_interval_s)
    assert reference.workload().source == REFERENCE and reference.workload().shape == REFERENCE_SHAPE
    waiting = Forecaster((3000,), 5.0, waiting_for_model=lambda: True)
    assert waiting.workload() is None and "once the model is loaded" in waiting.describe()


# ---- the thread's life in a real process ---------------------------------------------------------------

PROCESS = """
import json, os, sys, threading, time
import telemetry
from telemetry.model.indexer.backends import SimBackend
from telemetry.model.indexer.prefill import run_prefill
from telemetry.model.indexer.shape import IndexerShape
from telemetry.hook import set_allocator_source
from telemetry.hook.forecast import set_forecast_workload

backend = SimBackend("")
set_allocator_source(backend.counters, snapshot=backend.snapshot)
shape = IndexerShape(layers=2, chunk=1024, max_model_len=16384, logits_budget_bytes=8 << 20)
set_forecast_workload(shape)
handle = telemetry.install(["telemetry.model.indexer.launch:indexer_logits_launch"], port=None,
                           forecast_tokens=(8000,), forecast_interval_s=1)
run_prefill(backend, shape, "stock", 1000)

def first_forecast():
    deadline = time.monotonic() + 20
    while not handle.forecaster.results.forecasts and time.monotonic() < deadline:
        time.sleep(0.05)
    return [(f.tokens, f.reserved_growth_bytes) for f in handle.forecaster.results.forecasts]

parent = first_forecast()
if sys.argv[1] == "fork":
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        fresh = handle.forecaster.results.forecasts == () and handle.forecaster._thread is None
        run_prefill(backend, shape, "stock", 3000)   # the child's first hooked call starts its own thread
        child = first_forecast()
        names = [t.name for t in threading.enumerate()]
        os.write(write, json.dumps({"fresh": fresh, "child": child, "threads": names}).encode())
        os._exit(0)
    os.close(write)
    child = json.loads(os.read(read, 65536))
    os.waitpid(pid, 0)
    print(json.dumps({"parent": parent, **child}))
else:
    print(json.dumps({"parent": parent}))
# exit with the thread running: it must not keep the process alive
"""


def run_process(tmp_path: Path, mode: str) -> tuple[dict, float]:
    script = tmp_path / "forecast_process.py"
    script.write_text(textwrap.dedent(PROCESS))
    start = time.monotonic()
    result = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=60, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), time.monotonic() - start


def test_the_thread_does_not_keep_the_process_alive(tmp_path):
    out, seconds = run_process(tmp_path, "exit")
    assert out["parent"] and out["parent"][0][0] == 8000 and out["parent"][0][1] > 0
    assert seconds < 30   # the main thread's end is the process's end (a thread kept alive hits the timeout)


def test_a_forked_child_forecasts_its_own_allocator_in_its_own_thread(tmp_path):
    out, _ = run_process(tmp_path, "fork")
    assert out["fresh"], "the child inherited the parent's results or thread"
    assert out["child"] and "memtel-forecast" in out["threads"]
    assert out["child"][0][0] == 8000


def test_the_forecast_process_on_the_simulator():
    """test_forecast_gpu.py's process on the simulator: through the real exporter, exported = recomputed =
    what the next prefill adds, for each length in turn (from a state that grew at the step before)."""
    from tests.hook.forecast_process import check_exact, run_forecast_process

    out = run_forecast_process("sim", "stock", None)
    check_exact(out, peak=False)
    growth = [step["measured"]["reserved_growth_bytes"] for step in out["steps"]]
    assert all(g > 0 for g in growth), growth


def test_the_forecast_thread_lets_other_threads_run_at_most_every_millisecond_of_its_work():
    from telemetry.hook.forecast.runner import GilYield

    now = [0.0]
    naps: list[float] = []
    pause = GilYield(every_s=0.001, nap_s=0.00005, clock=lambda: now[0], sleep=naps.append)
    for _ in range(1000):       # 1,000 calls, 10 µs of work apart: 10 ms of work
        now[0] += 0.00001
        pause()
    assert len(naps) == 9 and set(naps) == {0.00005}   # at 1, 2, ... 9 ms (the 10th is due after the last call)


def test_a_forecast_with_a_pause_calls_it_every_launch_and_gives_the_same_answer():
    state = read_allocator_state([], device=0)
    calls = []
    paused = forecast(state, REFERENCE_SHAPE, 100_000, pause=lambda: calls.append(1))
    plain = forecast(state, REFERENCE_SHAPE, 100_000)
    assert paused == plain
    launches = run_prefill(SimBackend(), REFERENCE_SHAPE, "stock", 100_000).launches
    assert len(calls) == launches
