"""The allocator readers: torch's private nested binding, the public fallback, and allocator sources.

torch here is the CPU build: CUDA's entry points the hook calls are replaced by stand-ins (initialized,
device 0, not capturing) so the reader's own logic runs; what a real device returns is checked by
test_gpu.py on the device machine.
"""

from __future__ import annotations

import importlib
import json
import socket
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

import telemetry
from telemetry.allocator_counters import AllocatorCounters
from telemetry.hook import allocator, passthrough, set_allocator_source

NODE = socket.gethostname()


def nested(reserved, allocated, device_alloc, device_free=0, retries=0, ooms=0):
    """The shape of `torch._C._cuda_memoryStats(device)` (only the keys the hook reads, plus noise)."""
    return {"reserved_bytes": {"all": {"current": reserved, "peak": reserved}, "large_pool": {"current": 0}},
            "allocated_bytes": {"all": {"current": allocated}}, "num_device_alloc": device_alloc,
            "num_device_free": device_free, "num_alloc_retries": retries, "num_ooms": ooms, "num_sync_all_streams": 0}


def flat(reserved, allocated, device_alloc, device_free=0, retries=0, ooms=0):
    """The shape of `torch.cuda.memory_stats()`."""
    return {"reserved_bytes.all.current": reserved, "allocated_bytes.all.current": allocated,
            "num_device_alloc": device_alloc, "num_device_free": device_free, "num_alloc_retries": retries,
            "num_ooms": ooms, "active.all.current": 3}


@pytest.fixture
def stand_in_cuda(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", lambda device: (0, 0, 0), raising=False)
    set_allocator_source(None)   # a fresh CUDA reader, bound at the first read
    passthrough.reset()
    yield torch
    set_allocator_source(None)
    passthrough.reset()


def labels(site, **extra):
    return {"site": site, "rank": "0", "node": NODE, **extra}


def test_a_torch_without_the_private_binding_is_read_through_memory_stats_and_says_so_once(
        stand_in_cuda, monkeypatch, make_module, tmp_path, caplog):
    torch = stand_in_cuda
    monkeypatch.delattr(torch._C, "_cuda_memoryStats", raising=False)   # a torch that renamed it
    sequence = iter([flat(2 << 20, 1 << 20, 1), flat(2 << 20, 1 << 20, 1), flat(22 << 20, 9 << 20, 2, 0, 1),
                     flat(22 << 20, 3 << 20, 2, 0, 1)])
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: next(sequence))
    name = make_module("def f(x):\n    return x\n")
    module = importlib.import_module(name)
    registry = CollectorRegistry()
    caplog.set_level("WARNING", logger="memtel")
    handle = telemetry.install([f"{name}:f"], port=None, registry=registry, log_dir=tmp_path)  # baseline: 1st read
    for i in range(3):
        module.f(i)
    handle.flush()
    get = lambda metric, **kw: registry.get_sample_value(metric, labels(f"{name}:f", **kw))
    assert get("memtel_allocator_reserved_bytes") == 22 << 20 and get("memtel_allocator_allocated_bytes") == 3 << 20
    assert get("memtel_allocator_device_alloc_total") == 2 and get("memtel_allocator_alloc_retries_total") == 1
    assert get("memtel_hook_growth_events_total") == 1
    assert registry.get_sample_value("memtel_hook_allocator_reader_info",
                                     {"reader": "torch.cuda.memory_stats", "rank": "0", "node": NODE}) == 1
    records = [json.loads(line) for line in Path(handle.log_path).read_text().splitlines()]
    assert [(r["device"], r["num_device_alloc"], r["allocated_bytes"]) for r in records] == [
        ("cuda:0", 1, 1 << 20), ("cuda:0", 2, 9 << 20), ("cuda:0", 2, 3 << 20)]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1   # once per process, not per call
    assert "has no torch._C._cuda_memoryStats" in warnings[0] and "torch.cuda.memory_stats" in warnings[0]
    assert get("memtel_hook_errors_total", stage="allocator") is None


def test_the_private_binding_is_read_into_the_shared_counters_type(stand_in_cuda, monkeypatch, caplog):
    torch = stand_in_cuda
    stats = nested(40 << 20, 30 << 20, 5, 2, 1, 0)
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", lambda device: stats, raising=False)
    reader = allocator.current_reader()
    counters = reader.read()
    assert type(counters) is AllocatorCounters
    assert counters == AllocatorCounters.from_nested(stats) == AllocatorCounters(40 << 20, 30 << 20, 5, 2, 1, 0)
    assert (reader.kind, reader.device) == ("torch._C._cuda_memoryStats", "cuda:0")
    assert reader.read() is counters   # unchanged counters: the same object (the hot path skips its work)
    stats["num_device_alloc"] = 6
    changed = reader.read()
    assert changed is not None and changed.num_device_alloc == 6
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_a_reader_before_cuda_is_initialized_reads_nothing_and_binds_later(stand_in_cuda, monkeypatch):
    torch = stand_in_cuda
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", lambda device: nested(1, 1, 1), raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    reader = allocator.current_reader()
    assert reader.read() is None and reader.kind is None   # never initializes CUDA itself
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert reader.read() == AllocatorCounters(1, 1, 1, 0, 0, 0) and reader.kind == "torch._C._cuda_memoryStats"


def test_an_allocator_source_returns_the_counters_type_or_a_complete_dict():
    set_allocator_source(lambda: AllocatorCounters(1, 2, 3, 4, 5, 6), device="sim:1")
    reader = allocator.current_reader()
    assert reader.read() == (1, 2, 3, 4, 5, 6) and reader.device == "sim:1" and reader.kind == "allocator_source"
    set_allocator_source(lambda: {"reserved_bytes": 7, "allocated_bytes": 6, "num_device_alloc": 5,
                                  "num_device_free": 4, "num_alloc_retries": 3, "num_ooms": 2})
    assert allocator.current_reader().read() == AllocatorCounters(7, 6, 5, 4, 3, 2)
    set_allocator_source(lambda: {"reserved_bytes": 7})   # a lost field is an error, not a fake 0
    with pytest.raises(KeyError):
        allocator.current_reader().read()
    with pytest.raises(ValueError, match="allocator source must be a callable"):
        set_allocator_source(42)  # type: ignore[arg-type]
