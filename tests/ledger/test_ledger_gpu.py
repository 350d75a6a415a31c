"""On a CUDA machine: memory allocated outside PyTorch's caching allocator (a raw cuMemAlloc, as CUDA contexts,
NCCL or cuBLAS workspaces are) shows up in the ledger's `outside` line and in no other line; freed, it falls
back. The engine is a worker with weights-like and KV-like tensors on the GPU, signalled as vLLM's is."""

from __future__ import annotations

import ctypes
import json
import os

import pytest
from prometheus_client import CollectorRegistry

import telemetry
from telemetry.hook.config import HookConfig
from telemetry.ledger.lines import ProcessLedger

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")]

GiB = 1 << 30
MODULE = "tests.ledger.test_ledger_gpu"


class Runner:
    def __init__(self) -> None:
        self.model = torch.nn.Linear(8192, 8192, device="cuda")        # 256 MiB of weights
        self.kv_caches = [torch.zeros(64 << 20, device="cuda")]      # 256 MiB of KV cache


class Worker:
    def __init__(self) -> None:
        self.model_runner = Runner()

    def get_model(self):
        return self.model_runner.model

    def load_model(self) -> None:
        return None

    def initialize_from_config(self) -> None:
        return None


def nvml_process_bytes(pid: int) -> int | None:
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == pid:
                return int(process.usedGpuMemory) if process.usedGpuMemory is not None else None
        return None
    finally:
        pynvml.nvmlShutdown()


def ledger(registry: CollectorRegistry, node: str) -> ProcessLedger:
    labels = {"rank": "0", "node": node, "pid": str(os.getpid())}

    def value(name: str) -> int | None:
        found = registry.get_sample_value(name, labels)
        return None if found is None else int(found)

    return ProcessLedger.from_values(
        rank="0", pid=labels["pid"], weights=value("memtel_engine_weights_bytes"),
        kv_cache=value("memtel_engine_kv_cache_bytes"), cuda_graph_pool=value("memtel_engine_cuda_graph_pool_bytes"),
        reserved=value("memtel_engine_allocator_reserved_at_scrape_bytes"),
        allocated=value("memtel_engine_allocator_allocated_at_scrape_bytes"),
        nvml_process_bytes=nvml_process_bytes(os.getpid()),
        device_used_bytes=value("memtel_engine_device_used_bytes"), host_rss=value("memtel_engine_resident_bytes"))


def test_a_raw_cuda_allocation_shows_up_outside_the_allocator_and_nowhere_else():
    registry = CollectorRegistry()
    config = HookConfig(targets=(f"{MODULE}:Worker.get_model",), port=None, unresolved_after_s=None,
                        model_loaded=(f"{MODULE}:Worker.load_model",),
                        engine_memory=(f"{MODULE}:Worker.initialize_from_config",))
    handle = telemetry.hook.install_config(config, registry=registry)
    libcuda = ctypes.CDLL("libcuda.so.1")
    pointer = ctypes.c_uint64()
    try:
        worker = Worker()
        worker.load_model()
        worker.initialize_from_config()
        torch.cuda.synchronize()
        before = ledger(registry, handle.state.node)
        assert before.weights == 8192 * 8192 * 4 + 8192 * 4 and before.kv_cache == 256 << 20
        assert before.outside is not None and before.live_other is not None
        assert libcuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(GiB)) == 0
        during = ledger(registry, handle.state.node)
        assert libcuda.cuMemFree_v2(pointer) == 0
        pointer = ctypes.c_uint64()
        after = ledger(registry, handle.state.node)
        grew = during.outside - before.outside
        record = {"before": before.as_dict(), "during": during.as_dict(), "after": after.as_dict(),
                  "outside_growth_bytes": grew, "nvml_process_bytes": nvml_process_bytes(os.getpid()),
                  "torch": torch.__version__, "device": torch.cuda.get_device_name()}
        print("LEDGER-GPU " + json.dumps(record))
        out = os.environ.get("MEMTEL_GPU_RECORD_DIR")
        if out:
            with open(os.path.join(out, "ledger-gpu.json"), "w") as file:
                json.dump(record, file, indent=1)
        assert abs(grew - GiB) <= 2 << 20, f"outside grew by {grew} bytes, expected 1 GiB within 2 MiB"
        for line in ("weights", "kv_cache", "live_other", "allocator_cache", "reserved", "allocated"):
            assert getattr(during, line) == getattr(before, line), line
        assert abs(after.outside - before.outside) <= 2 << 20
    finally:
        if pointer.value:
            libcuda.cuMemFree_v2(pointer)
        handle.uninstall()
