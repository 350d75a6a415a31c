"""A serving rank in miniature on the lab's simulator, for test_tune_hook_gauge.py: the hook with its live
forecast, a fit budget, a scaled workload under non-default allocator settings, and the allocation history kept.

    python -m tests.tune.hook_gauge_process --port PORT

Builds allocator state (resident blocks, a few freed, prefills of several lengths), waits until the forecast has
fit from the idle allocator, prints one JSON line {"port", "gauge"} and keeps serving (idle) until stdin closes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from tests.support.prom import metric

MIB = 1 << 20
CONF = "max_split_size_mb:256"
HEADROOM = 100 * MIB
SHAPE = {"layers": 4, "chunk": 4096, "compress_ratio": 4, "max_model_len": 262_144,
         "logits_budget_bytes": 2048 * MIB, "topk": 512}
ROW_SCALE = 0.5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)

    import telemetry
    from telemetry.fit_budget import set_forecast_budget
    from telemetry.hook import set_allocator_source
    from telemetry.hook.forecast import set_forecast_workload
    from telemetry.hook.forecast.history import AllocationHistory, keep_history
    from telemetry.model.indexer.backends import SimBackend
    from telemetry.model.indexer.prefill import LaunchPattern, run_prefill
    from telemetry.model.indexer.shape import IndexerShape

    backend = SimBackend(CONF)
    history = AllocationHistory()
    sim = backend.main
    malloc, free = sim.malloc, sim.free

    def recorded_malloc(nbytes: int) -> int:
        handle = malloc(nbytes)
        history.alloc(handle, nbytes)
        return handle

    def recorded_free(handle: int) -> None:
        history.free(handle)
        free(handle)

    sim.malloc, sim.free = recorded_malloc, recorded_free   # type: ignore[method-assign]
    keep_history(history)
    shape = IndexerShape(**SHAPE)
    pattern = LaunchPattern(row_scale=ROW_SCALE)
    set_allocator_source(backend.counters, snapshot=backend.snapshot)
    set_forecast_workload(shape, pattern=pattern, alloc_conf=CONF)
    set_forecast_budget(lambda: HEADROOM, reserve_mib=0)
    handle = telemetry.install(["telemetry.model.indexer.launch:indexer_logits_launch"], port=args.port,
                               addr="127.0.0.1", forecast_tokens=(16_384,), forecast_interval_s=1.0)
    kept: list[Any] = [backend.alloc(n * MIB) for n in (300, 7, 120, 1, 64, 33)]
    for allocation in kept[1::2]:
        backend.release(allocation)
    for tokens in (20_000, 9_000, 20_000, 20_000, 41_000):
        run_prefill(backend, shape, "stock", tokens, pattern=pattern)
    idle_since = time.time()
    url = f"http://127.0.0.1:{args.port}/metrics"
    deadline = time.monotonic() + 60
    while True:
        success = metric(url, "memtel_forecast_last_success_timestamp_seconds")
        gauge = metric(url, "memtel_forecast_max_prefill_tokens")
        if success is not None and success > idle_since and gauge is not None:
            break
        if time.monotonic() > deadline:
            print(json.dumps({"error": "no fit after the allocator went idle"}), flush=True)
            return 1
        time.sleep(0.05)
    print(json.dumps({"port": args.port, "gauge": int(gauge)}), flush=True)
    sys.stdin.read()   # idle until the test is done
    handle.uninstall()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
