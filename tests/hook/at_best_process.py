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

from tests.hook.fit_process import MIB, attempt, start_forecast, wait_for_fit


def main() -> int:
    import torch

    shape, handle, backend = start_forecast()
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

    out["at_best_prefill"] = attempt(backend, shape, results.at_best.tokens)
    torch.cuda.empty_cache()
    out["chunk_more"] = attempt(backend, shape, min(results.at_best.tokens + shape.chunk, shape.max_model_len))
    del kept
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
