"""A serving rank in miniature with the live forecast on, for test_forecast_gpu.py (CUDA) and test_forecast.py (sim).

    python -m tests.hook.forecast_process --allocator cuda|sim --port PORT [--mode stock|fixed]

Builds allocator state (resident blocks, then a first prefill), then for each forecast length N in turn:
waits until the hook's forecast thread has forecast from the idle allocator (its success timestamp after
the allocator went idle), scrapes the real exporter, takes a snapshot at the same point in this thread and
runs `forecast()` on it, runs the prefill of N tokens, and measures what it added (reserved growth, device
allocs, peak reserved). Prints one JSON object: for each N the exported, the recomputed and the measured
figures. On CUDA the settings are the process's PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF (read by torch
and, the same way, by the forecast).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.support.http import get_text
from tests.support.ports import free_port
from tests.support.prom import metric

ROOT = Path(__file__).resolve().parents[2]

MiB = 1 << 20
RESIDENT = (3 * MiB, 17 * MiB, 40 * MiB, MiB // 2)   # live blocks of the process before any prefill
FIRST_PREFILL = 24_576
LENGTHS = (32_768, 65_536)


class Sim:
    """The lab's simulator backend: its `snapshot()` takes the backend's lock, as CUDA's takes the allocator's."""

    def __init__(self) -> None:
        from telemetry.model.indexer.backends import SimBackend

        self.inner = SimBackend("")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def peak_reserved(self) -> int | None:
        return None   # the simulator keeps no peak: the forecast's peak is checked against CUDA's only

    def reset_peak(self) -> None:
        """Nothing to reset."""


class Cuda:
    def __init__(self) -> None:
        from telemetry.model.indexer.backends import CudaBackend

        self.inner = CudaBackend(0)
        self.torch = self.inner.torch

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def snapshot(self) -> list:
        from telemetry.hook.allocator import cuda_memory_snapshot

        return cuda_memory_snapshot(self.torch)

    def peak_reserved(self) -> int:
        return int(self.torch.cuda.memory_stats(self.inner.index)["reserved_bytes.all.peak"])

    def reset_peak(self) -> None:
        self.torch.cuda.reset_peak_memory_stats(self.inner.index)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--allocator", choices=("cuda", "sim"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", choices=("stock", "fixed"), default="stock")
    args = parser.parse_args(argv)

    import telemetry
    from telemetry.hook import set_allocator_source
    from telemetry.hook.forecast import set_forecast_workload
    from telemetry.hook.forecast.workload import process_alloc_conf
    from telemetry.model.allocsim.snapshot import read_allocator_state
    from telemetry.model.indexer.forecast import forecast
    from telemetry.model.indexer.prefill import run_prefill
    from telemetry.model.indexer.shape import REFERENCE_SHAPE

    shape = REFERENCE_SHAPE
    backend: Any = Cuda() if args.allocator == "cuda" else Sim()
    device = backend.inner.index if args.allocator == "cuda" else None
    if args.allocator == "sim":
        set_allocator_source(backend.counters, snapshot=backend.snapshot)
    set_forecast_workload(shape, mode=args.mode)   # the allocator settings: the process's environment
    handle = telemetry.install(["telemetry.model.indexer.launch:indexer_logits_launch"], port=args.port,
                               addr="127.0.0.1",
                               forecast_tokens=LENGTHS, forecast_interval_s=1.0)
    url = f"http://127.0.0.1:{args.port}/metrics"
    kept = [backend.alloc(n) for n in RESIDENT]
    run_prefill(backend, shape, args.mode, FIRST_PREFILL)
    conf = process_alloc_conf(os.environ)
    out: dict[str, Any] = {"alloc_conf": conf, "mode": args.mode, "steps": []}
    for tokens in LENGTHS:
        backend.finish()
        idle_since = time.time()
        deadline = time.monotonic() + 120
        while True:
            success = metric(url, "memtel_forecast_last_success_timestamp_seconds")
            growth = metric(url, "memtel_forecast_reserved_growth_bytes")
            if success is not None and success > idle_since and growth is not None:
                break
            if time.monotonic() > deadline:
                print(json.dumps({"error": "no forecast after the allocator went idle",
                                  "metrics": get_text(url, timeout=10)[-3000:]}))
                return 1
            time.sleep(0.1)
        exported = {str(n): {name: metric(url, f"memtel_forecast_{name}", {"tokens": str(n)})
                             for name in ("reserved_growth_bytes", "peak_reserved_bytes", "device_alloc")}
                    for n in LENGTHS}
        state = read_allocator_state(backend.snapshot(), device=device)   # the same point: nothing ran since
        recomputed = {}
        for n in LENGTHS:
            f = forecast(state, shape, n, mode=args.mode, alloc_conf=conf)
            recomputed[str(n)] = {"reserved_growth_bytes": f.reserved_growth_bytes,
                                  "peak_reserved_bytes": f.peak_reserved_bytes, "device_alloc": f.num_device_alloc}
        before = backend.counters()
        backend.reset_peak()
        run_prefill(backend, shape, args.mode, tokens)
        backend.finish()
        after = backend.counters()
        measured = {"reserved_growth_bytes": after.reserved_bytes - before.reserved_bytes,
                    "device_alloc": after.num_device_alloc - before.num_device_alloc,
                    "peak_reserved_bytes": backend.peak_reserved()}
        out["steps"].append({"tokens": tokens, "segments": len(state.segments), "exported": exported,
                             "recomputed": recomputed, "measured": measured})
    out["duration_s"] = metric(url, "memtel_forecast_last_duration_seconds")
    out["failures"] = metric(url, "memtel_forecast_failures_total")
    out["workload_info"] = metric(url, "memtel_forecast_workload_info", {"source": "program", "mode": args.mode})
    del kept
    handle.uninstall()
    print(json.dumps(out))
    return 0


# ---- for the tests: run it, check it --------------------------------------------------------------------


def run_forecast_process(allocator: str, mode: str, alloc_conf: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    if alloc_conf is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run([sys.executable, "-m", "tests.hook.forecast_process", "--allocator", allocator,
                             "--port", str(free_port()), "--mode", mode], capture_output=True, text=True,
                            timeout=600, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def check_exact(out: dict, *, peak: bool) -> None:
    assert out["failures"] is None, out
    assert out["workload_info"] == 1
    grew = False
    for step in out["steps"]:
        n = str(step["tokens"])
        for tokens, exported in step["exported"].items():
            assert exported == step["recomputed"][tokens], (n, tokens, step)
        forecast = step["recomputed"][n]
        measured = step["measured"]
        assert measured["reserved_growth_bytes"] == forecast["reserved_growth_bytes"], step
        assert measured["device_alloc"] == forecast["device_alloc"], step
        if peak:
            assert measured["peak_reserved_bytes"] == forecast["peak_reserved_bytes"], step
        grew |= measured["reserved_growth_bytes"] > 0
    assert grew or out["mode"] == "fixed", "no prefill grew the allocator: the check proved nothing"


if __name__ == "__main__":
    sys.exit(main())
