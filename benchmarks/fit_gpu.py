"""The longest prefill that fits, against a real GPU: the out-of-memory boundary under a per-process memory cap.

    PYTHONPATH=. python3 benchmarks/fit_gpu.py --out DIR [--cap-gib 1.1] [--parallel 8] [--confs default,expandable]

For each allocator setting (the defaults, `expandable_segments:True`), each with `per_process_memory_fraction`
set so the process may reserve about --cap-gib GiB:

1. a probe process builds one allocator state (the same warm-up every time: a prefill, then a few resident
   tensors of mixed sizes) and saves its `torch.cuda.memory_snapshot()` and the device's total memory;
2. this process (which never touches CUDA) simulates from that snapshot, with the same settings and total:
   the longest prefill that fits (`max_prefill_tokens`; the limit is the device's free memory, so the cap is
   what binds) and the simulator's verdict and peak reserved for lengths around it and across the range;
3. a fresh probe process per length (--parallel at a time on the one GPU, each under its own cap) builds the
   same state, runs the real prefill (`run_prefill` on `CudaBackend`) and reports whether it ran out of memory
   (torch.OutOfMemoryError), its peak reserved, and its reserved bytes after every allocator op;
4. compares each length: real verdict and peak against the simulator's; where they differ, the first op where
   the reserved bytes differ.

Writes DIR/fit-gpu.json (everything) and prints a summary. The workload: 4 indexer layers, 8,192-token chunks,
compress ratio 4, max-model-len 204,800, a 512 MiB logits budget, stock width (the reference shape with fewer
layers, so a probe takes seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIB = 1 << 20
GIB = 1 << 30
CONFS = {"default": "", "expandable": "expandable_segments:True"}
SHAPE = {"layers": 4, "chunk": 8192, "compress_ratio": 4, "max_model_len": 204_800,
         "logits_budget_bytes": 512 * MIB}


def shape() -> Any:
    from telemetry.model.indexer.shape import IndexerShape

    return IndexerShape(**SHAPE)


def warm_up(backend: Any) -> list[object]:
    """The same allocator state every time: a 40,000-token prefill, then resident tensors of mixed sizes."""
    from telemetry.model.indexer.prefill import run_prefill

    run_prefill(backend, shape(), "stock", 40_000)
    kept = [backend.alloc(n) for n in (37 * MIB, 3 * MIB, 700 * 1024, 200 * MIB, 12 * MIB + 4096)]
    backend.release(kept.pop(1))
    return kept


# ---- the probe process (CUDA) --------------------------------------------------------------------------------

def probe(tokens: int) -> dict[str, Any]:
    import torch

    from telemetry.hook.allocator import cuda_memory_snapshot
    from telemetry.model.indexer.backends import CudaBackend
    from telemetry.model.indexer.prefill import PrefillObserver, run_prefill

    backend = CudaBackend(0)
    kept = warm_up(backend)
    torch.cuda.synchronize()
    start = backend.counters()
    out: dict[str, Any] = {"tokens": tokens, "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                           "start_reserved": start.reserved_bytes, "start_allocated": start.allocated_bytes}
    if tokens == 0:   # the state itself
        free, total = torch.cuda.mem_get_info(0)
        out.update(snapshot=cuda_memory_snapshot(torch), device_free=free, device_total=total,
                   device=torch.cuda.get_device_name(0), torch=torch.__version__)
        return out

    class Ops(PrefillObserver):
        def __init__(self) -> None:
            self.reserved: list[int] = []
            self.where = (-1, -1, -1)

        def launch_started(self, step: Any, layer: int, index: int) -> None:
            self.where = (step.index, layer, index)

        def op_done(self, op: list[object]) -> None:
            self.reserved.append(backend.counters().reserved_bytes)

    ops = Ops()
    torch.cuda.reset_peak_memory_stats(0)
    try:
        run_prefill(backend, shape(), "stock", tokens, observer=ops)
        torch.cuda.synchronize()
        oom = False
    except torch.OutOfMemoryError:
        oom = True
    end = backend.counters()
    out.update(out_of_memory=oom, peak_reserved=int(torch.cuda.max_memory_reserved(0)), end=list(end),
               where=list(ops.where) if oom else None, ops_reserved=ops.reserved)
    del kept
    return out


def run_probe(conf: str, tokens: int) -> dict[str, Any]:
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, __file__, "--probe", str(tokens)], capture_output=True, text=True,
                          env=env, timeout=300)
    if done.returncode != 0:
        return {"tokens": tokens, "error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- the simulator side (no CUDA) ------------------------------------------------------------------------------

def simulate(state_probe: dict[str, Any], conf: str) -> tuple[Any, Any]:
    from telemetry.model.allocsim.snapshot import read_allocator_state
    from telemetry.model.indexer.fit import max_prefill_tokens

    state = read_allocator_state(state_probe["snapshot"], device=0)
    limit = state.counters.reserved_bytes + int(state_probe["device_free"])   # the physical memory: not binding
    fit = max_prefill_tokens(state, shape(), limit_bytes=limit, alloc_conf=conf,
                             total_memory=int(state_probe["device_total"]))
    return state, fit


def sim_verdict(state: Any, conf: str, total: int, limit: int, tokens: int) -> dict[str, Any]:
    from telemetry.model.indexer.forecast import simulate_prefill

    result, watch = simulate_prefill(state, shape(), tokens, alloc_conf=conf, capacity_bytes=limit,
                                     total_memory=total)
    return {"out_of_memory": result.out_of_memory, "peak_reserved": result.peak_reserved_bytes,
            "step": watch.step}


def sim_ops_reserved(state: Any, conf: str, total: int, limit: int, tokens: int) -> list[int]:
    from telemetry.model.allocsim.simulator import SimulatedOutOfMemoryError
    from telemetry.model.allocsim.snapshot import seeded_simulator
    from telemetry.model.indexer.forecast import _SeededBackend
    from telemetry.model.indexer.prefill import PrefillObserver, run_prefill

    sim = seeded_simulator(state, conf, capacity_bytes=limit, total_memory=total)
    reserved: list[int] = []

    class Ops(PrefillObserver):
        def op_done(self, op: list[object]) -> None:
            reserved.append(sim.reserved_bytes)

    try:
        run_prefill(_SeededBackend(sim), shape(), "stock", tokens, observer=Ops())
    except SimulatedOutOfMemoryError:
        pass
    return reserved


def lengths_to_probe(fit: Any, chunk: int, top: int) -> list[int]:
    g = fit.tokens
    chosen = {g, g + 1, g + 2, g - 1, g + chunk, g - chunk, g // 2, 1, chunk, (g // chunk) * chunk,
              (g // chunk) * chunk + 1, (g // chunk + 1) * chunk, top}
    return sorted(n for n in chosen if 1 <= n <= top)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--cap-gib", type=float, default=1.1)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--confs", default="default,expandable")
    parser.add_argument("--probe", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe is not None:
        print(json.dumps(probe(args.probe)))
        return 0
    if args.out is None:
        parser.error("--out DIR is required")
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "shape": SHAPE,
                              "cap_gib": args.cap_gib, "confs": {}}
    # The device's total, from one probe of the plain state, sets the fraction for the cap.
    first = run_probe("", 0)
    if "error" in first:
        print(first["error"], file=sys.stderr)
        return 1
    total = int(first["device_total"])
    fraction = round(args.cap_gib * GIB / total, 6)
    report.update(device=first["device"], torch=first["torch"], device_total=total, fraction=fraction)
    print(f"{first['device']}, torch {first['torch']}, total {total:,} bytes; fraction {fraction} "
          f"(cap {fraction * total / GIB:.3f} GiB)", flush=True)
    for name in args.confs.split(","):
        conf = ",".join(p for p in (CONFS[name], f"per_process_memory_fraction:{fraction}") if p)
        started = time.monotonic()
        state_probe = run_probe(conf, 0)
        if "error" in state_probe:
            report["confs"][name] = {"conf": conf, "error": state_probe["error"]}
            print(f"{name}: state probe failed:\n{state_probe['error']}", flush=True)
            continue
        state, fit = simulate(state_probe, conf)
        limit = fit.limit_bytes
        lengths = lengths_to_probe(fit, SHAPE["chunk"], SHAPE["max_model_len"])
        with ThreadPoolExecutor(args.parallel) as pool:
            real = list(pool.map(lambda n, conf=conf: run_probe(conf, n), lengths))
        rows = []
        for n, measured in zip(lengths, real, strict=True):
            simulated = sim_verdict(state, conf, total, limit, n)
            row = {"tokens": n, "sim": simulated, "real": {k: v for k, v in measured.items() if k != "ops_reserved"}}
            if "error" not in measured:
                same_peak = simulated["peak_reserved"] == measured["peak_reserved"]
                row["agree"] = (simulated["out_of_memory"] == measured["out_of_memory"]
                                and (measured["out_of_memory"] or same_peak))
                if not row["agree"]:
                    sim_ops = sim_ops_reserved(state, conf, total, limit, n)
                    real_ops = measured["ops_reserved"]
                    first_diff = next((i for i, (a, b) in enumerate(zip(sim_ops, real_ops, strict=False)) if a != b),
                                      min(len(sim_ops), len(real_ops)))
                    row["first_difference"] = {"op": first_diff, "sim_ops": len(sim_ops), "real_ops": len(real_ops),
                                               "sim": sim_ops[max(0, first_diff - 3):first_diff + 3],
                                               "real": real_ops[max(0, first_diff - 3):first_diff + 3]}
            rows.append(row)
            verdict = "OOM" if measured.get("out_of_memory") else ("error" if "error" in measured else "fits")
            print(f"  {name} {n:>7,} tokens: real {verdict:>5} peak {measured.get('peak_reserved', 0) / MIB:8.0f} MiB"
                  f" | sim {'OOM' if simulated['out_of_memory'] else 'fits':>5} peak "
                  f"{simulated['peak_reserved'] / MIB:8.0f} MiB  {'agree' if row.get('agree') else 'DIFFER'}",
                  flush=True)
        agree = all(r.get("agree") for r in rows)
        report["confs"][name] = {"conf": conf, "start_reserved": state.counters.reserved_bytes,
                                 "segments": len(state.segments), "max_fit": fit.as_json(), "rows": rows,
                                 "all_agree": agree, "seconds": round(time.monotonic() - started, 1),
                                 "snapshot": state_probe["snapshot"]}
        print(f"{name}: gauge {fit.tokens:,} tokens (limit by the cap; {fit.simulations} simulated prefills); "
              f"{'every probed length agrees' if agree else 'SOME LENGTHS DIFFER'} "
              f"({report['confs'][name]['seconds']} s)", flush=True)
    (args.out / "fit-gpu.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
