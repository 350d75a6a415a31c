"""A CUDA process under a memory cap with the live forecast on, for test_fit_gpu.py (the `gpu` test).

    PYTORCH_CUDA_ALLOC_CONF=...,per_process_memory_fraction:F python -m tests.hook.fit_process
    PYTORCH_CUDA_ALLOC_CONF=... MEMTEL_GUARD_RESERVE_MB=0 python -m tests.hook.fit_process   # beside a holder

Installs the hook with the forecast on (the forecast's helper process searches the longest prefill that fits),
builds allocator state, then: reads `memtel_forecast_max_prefill_tokens` (the forecaster's result from a
snapshot of the idle allocator), runs a prefill of exactly that many tokens, reads the gauge again from the
state that left, and runs a prefill one chunk longer than it. Prints one JSON object: the gauges, what the
forecast said of each length, and whether each real prefill ran out of memory.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

MIB = 1 << 20
SHAPE = {"layers": 4, "chunk": 8192, "compress_ratio": 4, "max_model_len": 204_800, "logits_budget_bytes": 512 * MIB}


def wait_for_fit(forecaster: Any, after: float, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        results = forecaster.results
        if results.max_fit is not None and results.last_success_s is not None and results.last_success_s > after:
            return results
        time.sleep(0.05)
    raise SystemExit(f"no fit from after {after}: {forecaster.results}")


def start_forecast() -> tuple[Any, Any, Any]:
    """The hook installed with the forecast on (SHAPE, the program's workload) and a CUDA backend that ran one
    prefill of 40,000 tokens: (shape, handle, backend)."""
    import telemetry
    from telemetry.hook.forecast import set_forecast_workload
    from telemetry.model.indexer.backends import CudaBackend
    from telemetry.model.indexer.prefill import run_prefill
    from telemetry.model.indexer.shape import IndexerShape

    shape = IndexerShape(**SHAPE)
    set_forecast_workload(shape)
    handle = telemetry.install(["telemetry.model.indexer.launch:indexer_logits_launch"], port=None,
                               forecast_tokens=(32768,), forecast_interval_s=1.0)
    backend = CudaBackend(0)
    run_prefill(backend, shape, "stock", 40_000)
    return shape, handle, backend


def attempt(backend: Any, shape: Any, tokens: int) -> dict[str, Any]:
    """A real prefill of `tokens`: whether it ran out of memory, its peak reserved bytes and what stayed reserved."""
    import torch

    from telemetry.model.indexer.prefill import run_prefill

    torch.cuda.reset_peak_memory_stats(0)
    try:
        run_prefill(backend, shape, "stock", tokens)
        torch.cuda.synchronize()
        oom = False
    except torch.OutOfMemoryError:
        oom = True
    return {"tokens": tokens, "out_of_memory": oom, "peak_reserved": int(torch.cuda.max_memory_reserved(0)),
            "reserved_after": int(torch.cuda.memory_reserved(0))}


def main() -> int:
    import torch

    from telemetry.hook.allocator import cuda_memory_snapshot
    from telemetry.model.allocsim.snapshot import read_allocator_state
    from telemetry.model.indexer.forecast import forecast

    shape, handle, backend = start_forecast()
    kept = [backend.alloc(n) for n in (37 * MIB, 3 * MIB, 700 * 1024, 200 * MIB, 12 * MIB + 4096)]
    backend.release(kept.pop(1))
    torch.cuda.synchronize()
    forecaster = handle.forecaster
    out: dict[str, Any] = {"conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                           "device": torch.cuda.get_device_name(0)}

    def forecast_of(tokens: int, results: Any) -> dict[str, Any]:
        state = read_allocator_state(cuda_memory_snapshot(torch), device=0)
        f = forecast(state, shape, tokens, alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                     capacity_bytes=results.budget.limit_bytes, total_memory=results.budget.total_memory)
        return {"out_of_memory": f.out_of_memory, "peak_reserved": f.peak_reserved_bytes}

    first = wait_for_fit(forecaster, time.time())
    gauge = first.max_fit.tokens
    out["first"] = {"gauge": gauge, "budget": first.budget.budget_bytes, "limit": first.budget.limit_bytes,
                    "detail": first.budget.detail,
                    "total_memory": first.budget.total_memory, "simulations": first.max_fit.simulations,
                    "forecast": forecast_of(gauge, first), **attempt(backend, shape, gauge)}
    second = wait_for_fit(forecaster, time.time())
    longer = min(second.max_fit.tokens + shape.chunk, shape.max_model_len)
    out["second"] = {"gauge": second.max_fit.tokens, "forecast": forecast_of(longer, second),
                     **attempt(backend, shape, longer)}
    handle.uninstall()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
