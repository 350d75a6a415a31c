"""The hook on a real CUDA caching allocator (marker gpu: run on the device machine).

Per-call values equal `torch.cuda.memory_stats()` read at the same point; growth events happen
exactly when num_device_alloc rises; nothing synchronizes (sync debug mode "error" would raise,
and the hook would count it as an error); CUDA graph capture passes straight through; a process
whose CUDA is not initialized is not initialized by the hook.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

import telemetry

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
NODE = socket.gethostname()

SOURCE = """
import torch

kept = []

def logits(rows, cols, keep=True):
    # Like the indexer's logits: float32 [rows, cols], cols growing with the context.
    out = torch.empty((rows, cols), dtype=torch.float32, device="cuda")
    if keep:
        kept.append(out)
    return out

def scale(x):
    return x * 2
"""

STAT_KEYS = {
    "reserved_bytes": "reserved_bytes.all.current",
    "allocated_bytes": "allocated_bytes.all.current",
    "num_device_alloc": "num_device_alloc",
    "num_device_free": "num_device_free",
    "num_alloc_retries": "num_alloc_retries",
    "num_ooms": "num_ooms",
}


def labels(site, **extra):
    return {"site": site, "rank": "0", "node": NODE, **extra}


@pytest.fixture
def torch_cuda():
    torch = pytest.importorskip("torch")
    torch.zeros(1, device="cuda")  # initialize CUDA before install: the baseline is read then
    return torch


def read_records(handle) -> list[dict]:
    handle.flush()
    return [json.loads(line) for line in Path(handle.log_path).read_text().splitlines()]


def test_per_call_values_equal_memory_stats_at_the_same_point(torch_cuda, make_module, tmp_path):
    torch = torch_cuda
    name = make_module(SOURCE)
    module = importlib.import_module(name)
    site = f"{name}:logits"
    registry = CollectorRegistry()
    handle = telemetry.install([site], port=None, registry=registry, log_dir=tmp_path)
    truths = []
    for step, (rows, cols) in enumerate([(512, 4096), (512, 8192), (16, 16), (512, 65536), (2048, 65536)]):
        out = module.logits(rows, cols, keep=step % 2 == 0)  # held: the hook read while it was alive
        stats = torch.cuda.memory_stats()  # the same point: nothing allocates or frees in between
        del out
        truth = {field: stats[key] for field, key in STAT_KEYS.items()}
        truths.append(truth)
        for field, metric in (("reserved_bytes", "memtel_allocator_reserved_bytes"),
                              ("allocated_bytes", "memtel_allocator_allocated_bytes"),
                              ("num_device_alloc", "memtel_allocator_device_alloc_total"),
                              ("num_device_free", "memtel_allocator_device_free_total"),
                              ("num_alloc_retries", "memtel_allocator_alloc_retries_total"),
                              ("num_ooms", "memtel_allocator_ooms_total")):
            assert registry.get_sample_value(metric, labels(site)) == truth[field], (step, metric)
    records = read_records(handle)
    assert len(records) == len(truths)
    for record, truth in zip(records, truths, strict=True):
        assert {field: record[field] for field in STAT_KEYS} == truth
        assert record["device"] == f"cuda:{torch.cuda.current_device()}"
    module.kept.clear()


def test_growth_events_exactly_when_num_device_alloc_rises(torch_cuda, make_module, tmp_path):
    torch = torch_cuda
    name = make_module(SOURCE)
    module = importlib.import_module(name)
    site = f"{name}:logits"
    torch.cuda.empty_cache()
    registry = CollectorRegistry()
    handle = telemetry.install([site], port=None, registry=registry, log_dir=tmp_path)
    expected_growth = 0
    rises = []
    for step in range(24):
        # Prefill-chunk pattern: the logits width grows with the context up to a budget, then stays;
        # some are kept, some freed (a freed block of the capped width is reused: no new segment).
        before = torch.cuda.memory_stats()["num_device_alloc"]
        module.logits(256, 8192 * min(step + 1, 8), keep=step % 3 == 0)
        rose = torch.cuda.memory_stats()["num_device_alloc"] > before
        rises.append(rose)
        expected_growth += rose
        assert registry.get_sample_value("memtel_hook_growth_events_total", labels(site)) == expected_growth, step
    assert any(rises) and not all(rises)  # the loop both grew and reused cached segments
    records = read_records(handle)
    allocs = [r["num_device_alloc"] for r in records]
    assert [b > a for a, b in itertools.pairwise(allocs)] == rises[1:]
    module.kept.clear()


def test_no_device_synchronization(torch_cuda, make_module):
    torch = torch_cuda
    name = make_module(SOURCE)
    module = importlib.import_module(name)
    site = f"{name}:logits"
    registry = CollectorRegistry()
    telemetry.install([site], port=None, registry=registry)
    try:
        with warnings.catch_warnings():   # torch 2.11 warns that the mode is a prototype (filterwarnings=error)
            warnings.filterwarnings("ignore", "Synchronization debug mode", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        for step in range(10):
            module.logits(128, 1024 * (step + 1))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert registry.get_sample_value("memtel_hook_calls_total", labels(site)) == 10
    # A synchronizing call inside the hook would have raised there and been counted as an error.
    errors = [s for m in registry.collect() if m.name == "memtel_hook_errors" for s in m.samples]
    assert errors == []
    module.kept.clear()


def test_cuda_graph_capture_passes_straight_through(torch_cuda, make_module):
    torch = torch_cuda
    name = make_module(SOURCE)
    module = importlib.import_module(name)
    site = f"{name}:scale"
    registry = CollectorRegistry()
    telemetry.install([site], port=None, registry=registry)
    static_in = torch.ones(1024, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        module.scale(static_in)  # warm-up outside capture: recorded
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = module.scale(static_in)  # during capture: not recorded
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, torch.full_like(static_in, 2.0))
    assert registry.get_sample_value("memtel_hook_calls_total", labels(site)) == 1
    assert registry.get_sample_value("memtel_hook_errors_total", labels(site, stage="guard")) is None
    module.scale(static_in)
    assert registry.get_sample_value("memtel_hook_calls_total", labels(site)) == 2


def test_allocator_fields_absent_before_cuda_init_and_the_hook_never_initializes_it(tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "gpu_mod.py").write_text("def f(x):\n    return x\n")
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "import torch, telemetry\n"
        f"h = telemetry.install(['gpu_mod:f'], port=None, log_dir={str(tmp_path)!r})\n"
        "import gpu_mod\n"
        "gpu_mod.f(1)\n"
        "initialized_by_hook = torch.cuda.is_initialized()\n"
        "torch.zeros(1, device='cuda')\n"
        "gpu_mod.f(2)\n"
        "h.flush()\n"
        "print(json.dumps({'initialized_by_hook': initialized_by_hook,\n"
        "                  'records': [json.loads(l) for l in open(h.log_path)]}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["initialized_by_hook"] is False
    first, second = result["records"]
    assert "reserved_bytes" not in first and first["device"] == "cpu" and first["mem_available_bytes"] > 0
    assert second["device"].startswith("cuda:") and second["num_device_alloc"] >= 1
