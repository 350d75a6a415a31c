"""The hook's live forecast started on this process's CUDA allocator, for the GPU helper processes
(shadow_process.py, snapshot_native_process.py): run there, never under pytest on a machine without CUDA."""

from __future__ import annotations

import time
from typing import Any

MIB = 1 << 20
FORECAST_TOKENS = 20000


def hooked_forecaster(interval_s: float) -> tuple[Any, Any, Any]:
    """(handle, forecaster, shape): the hook on the indexer launch with the live forecast of a 4-layer workload at
    FORECAST_TOKENS tokens every `interval_s`, its first hooked call made (it binds the device) and its first
    forecast waited for (at most 120 s; the caller checks there is one)."""
    import telemetry
    from telemetry.hook.forecast import set_forecast_workload
    from telemetry.model.indexer.backends import CudaBackend
    from telemetry.model.indexer.shape import IndexerShape

    shape = IndexerShape(layers=4, chunk=8192, compress_ratio=4, max_model_len=65536, logits_budget_bytes=64 * MIB)
    set_forecast_workload(shape)
    backend = CudaBackend(0)
    handle = telemetry.install(["telemetry.model.indexer.launch:indexer_logits_launch"], port=None,
                               forecast_tokens=(FORECAST_TOKENS,), forecast_interval_s=interval_s)
    backend.release(backend.launch(64, 4096, 4096))   # the first hooked call binds the device
    forecaster = handle.forecaster
    assert forecaster is not None
    deadline = time.monotonic() + 120
    while not forecaster.results.forecasts and time.monotonic() < deadline:
        time.sleep(0.05)
    return handle, forecaster, shape
