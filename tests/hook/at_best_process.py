"""A CUDA process under a memory cap with the live forecast on, for test_fit_gpu.py's at-best test (`gpu`).

    PYTORCH_CUDA_ALLOC_CONF=...,per_process_memory_fraction:F python -m tests.hook.at_best_process

Installs the hook with the forecast on, runs a prefill, keeps a few tensors live, then allocates and frees a few
growing tensors (their segments stay cached). Reads the forecaster's `max_fit` (memtel_forecast_max_prefill_tokens)
and `at_best` (memtel_forecast_max_prefill_tokens_at_best) from a snapshot of that idle allocator, calls
torch.cuda.empty_cache(), and runs a prefill of exactly the at-best length, then one a chunk longer. Prints one
JSON object: the gauges, the bytes the cache held, and whether each real prefill ran out of memory.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from tests.hook.fit_process import SHAPE, wait_for_fit

MIB = 1 << 20


def main() -> int:
    import torch

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
    kept = [backend.alloc(n) for n in (37 * MIB, 700 * 1024, 12 * MIB + 4096)]
    for size in (48 * MIB, 96 * MIB, 160 * MIB):   # growing allocations, freed: their segments stay cached
        backend.release(backend.alloc(size))
    torch.cuda.synchronize()
    cached = int(torch.cuda.memory_reserved(0) - torch.cuda.memory_allocated(0))
    results = wait_for_fit(handle.forecaster, time.time())
    assert results.at_best is not None, "no at-best result with a fit budget"
    out: dict[str, Any] = {"conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                           "device": torch.cuda.get_device_name(0), "held_free_bytes": cached,
                           "gauge": results.max_fit.tokens, "at_best": results.at_best.tokens,
                           "limit": results.budget.limit_bytes}
    handle.uninstall()
    torch.cuda.empty_cache()
    out["reserved_after_empty_cache"] = int(torch.cuda.memory_reserved(0))

    def attempt(tokens: int) -> dict[str, Any]:
        torch.cuda.reset_peak_memory_stats(0)
        try:
            run_prefill(backend, shape, "stock", tokens)
            torch.cuda.synchronize()
            oom = False
        except torch.OutOfMemoryError:
            oom = True
        return {"tokens": tokens, "out_of_memory": oom, "peak_reserved": int(torch.cuda.max_memory_reserved(0))}

    out["at_best_prefill"] = attempt(results.at_best.tokens)
    torch.cuda.empty_cache()
    out["chunk_more"] = attempt(min(results.at_best.tokens + shape.chunk, shape.max_model_len))
    del kept
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
