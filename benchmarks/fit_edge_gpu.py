"""The longest prefill that fits on a shared device: the exact out-of-memory edge under the device's own limit.

    PYTHONPATH=. python3 benchmarks/fit_edge_gpu.py --out DIR [--free-gib 6] [--states warm,messy,holes,after_long]
                                                    [--confs default,expandable] [--deadline-s 420]

1. A holder process takes all of the device but --free-gib GiB (one plain allocation), kept to the end: the
   other tenant of a shared GPU.
2. The driver (a fresh process per setting): cudaMemGetInfo's free memory against the largest single
   cuMemAlloc (found by bisection, to the byte), and against what the caching allocator gets by filling the
   device with 20 MiB segments (pages under expandable segments) and then 2 MiB small-pool segments.
3. For each allocator state of this file (`STATES`) and each setting: a fresh process builds the state and
   records its `torch.cuda.memory_snapshot()` and the device's free memory; the simulator from that snapshot
   predicts the edge; fresh processes (one per length, the holder still holding) probe the prediction and the
   token after it, then walk and bisect until the longest length that fits and the first that runs out of
   memory are one token apart.

Writes DIR/fit-edge.json (everything, the snapshots too) after every state, and prints a table.
The workload is the shared fit-truth's: 4 indexer layers, 8,192-token chunks, ratio 4, 2,048 MiB logits budget,
top-k 2,048, max-model-len 1,048,576, stock width.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIB = 1 << 20
GIB = 1 << 30
CONFS = {"default": "", "expandable": "expandable_segments:True", "split256": "max_split_size_mb:256"}
SHAPE = {"layers": 4, "chunk": 8192, "compress_ratio": 4, "max_model_len": 1 << 20,
         "logits_budget_bytes": 2048 * MIB, "topk": 2048}
ISSUE_SLACK = 3_735_552   # cudaMemGetInfo free less the largest cuMemAlloc (issue 32; BENCHMARKS.md, 2026-12-02)


def shape() -> Any:
    from telemetry.model.indexer.shape import IndexerShape

    return IndexerShape(**SHAPE)


# ---- the allocator states (any LaunchBackend: CudaBackend here, SimBackend in tests) ---------------------------

def state_warm(backend: Any) -> list[object]:
    """A warm 64k prefill, then mixed resident tensors and a 1.5 GiB block (a KV cache)."""
    from telemetry.model.indexer.prefill import run_prefill

    run_prefill(backend, shape(), "stock", 65_536)
    kept = [backend.alloc(n) for n in (37 * MIB, 3 * MIB, 700 * 1024, 200 * MIB, 12 * MIB + 4096, 1536 * MIB)]
    backend.release(kept.pop(1))
    return kept


def state_messy(backend: Any) -> list[object]:
    """Residents of 50-400 MiB, 200 mixed tensors with half freed in random order, four 256 MiB KV blocks,
    then a 32k prefill."""
    from telemetry.model.indexer.prefill import run_prefill

    rng = random.Random(32)
    kept = [backend.alloc(rng.randrange(50, 400) * MIB + rng.randrange(0, MIB, 512)) for _ in range(6)]
    mixed = [backend.alloc(rng.choice((rng.randrange(512, MIB), rng.randrange(MIB, 64 * MIB))))
             for _ in range(200)]
    order = list(range(len(mixed)))
    rng.shuffle(order)
    for index in sorted(order[:100], reverse=True):
        backend.release(mixed.pop(index))
    kept += mixed
    kept += [backend.alloc(256 * MIB) for _ in range(4)]
    run_prefill(backend, shape(), "stock", 32_768)
    return kept


def state_holes(backend: Any) -> list[object]:
    """A 1 GiB resident, then 30 segments of 64 MiB with every other one freed (cached holes the prefill's
    large launches cannot use; the allocator must free them when the device is full)."""
    kept = [backend.alloc(1024 * MIB)]
    blocks = [backend.alloc(64 * MIB) for _ in range(30)]
    for index in range(0, 30, 2):
        backend.release(blocks[index])
    kept += blocks[1::2]
    kept.append(backend.alloc(5 * MIB))
    return kept


def state_after_long(backend: Any) -> list[object]:
    """A 300k prefill (its 2 GiB launches stay cached), then a 1 GiB resident and small tensors."""
    from telemetry.model.indexer.prefill import run_prefill

    run_prefill(backend, shape(), "stock", 300_000)
    kept = [backend.alloc(1024 * MIB)]
    kept += [backend.alloc(n) for n in (4096, 96 * 1024, 600 * 1024, 3 * MIB)]
    return kept


def state_holes_launched(backend: Any) -> list[object]:
    """`state_holes` in a process that has launched a kernel first (as a serving engine has): a sleep kernel,
    which allocates nothing."""
    import torch

    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    return state_holes(backend)


def state_holes_filled(backend: Any) -> list[object]:
    """`state_holes` after the prefill's own kernel has run once (a float32 fill of part of the resident): its
    module is loaded before the snapshot, as in an engine that has served."""
    kept: list[Any] = state_holes(backend)
    kept[0].view(backend.torch.float32).view(1024, -1)[:, :10].fill_(1.0)
    return kept


STATES = {"warm": state_warm, "messy": state_messy, "holes": state_holes, "after_long": state_after_long,
          "holes_launched": state_holes_launched, "holes_filled": state_holes_filled}


# ---- processes on the device -----------------------------------------------------------------------------------

def hold(free_gib: float) -> None:
    """The other tenant: take all but free_gib GiB, say so, hold until stdin closes."""
    import torch

    torch.cuda.init()
    free, _ = torch.cuda.mem_get_info(0)
    take = max(free - int(free_gib * GIB), 0) // (2 * MIB) * (2 * MIB)
    block = torch.empty(take, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    print(json.dumps({"held": take, "free_after": torch.cuda.mem_get_info(0)[0]}), flush=True)
    sys.stdin.read()
    del block


def driver() -> dict[str, Any]:
    """What the driver gives near a full device, in this process's allocator setting."""
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda:0")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    out: dict[str, Any] = {"conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    free0, total = torch.cuda.mem_get_info(0)
    out.update(free=free0, total=total, reserved_at_start=torch.cuda.memory_reserved(0))
    if not out["conf"]:
        cuda = ctypes.CDLL("libcuda.so.1")

        def fits(n: int) -> bool:
            pointer = ctypes.c_uint64()
            if cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(n)) != 0:
                return False
            cuda.cuMemFree_v2(pointer)
            return True

        good, bad = 0, free0 + 64 * MIB
        while bad - good > 1:
            middle = (good + bad) // 2
            good, bad = (middle, bad) if fits(middle) else (good, middle)
        out["largest_cumemalloc"] = good
        out["free_after_bisection"] = torch.cuda.mem_get_info(0)[0]
    for label, nbytes in (("fill_20mib", 20 * MIB), ("fill_2mib", MIB)):
        held = []
        try:
            while True:
                held.append(torch.empty(nbytes, dtype=torch.uint8, device="cuda:0"))
        except torch.OutOfMemoryError:
            pass
        torch.cuda.synchronize()
        out[label] = {"tensors": len(held), "reserved": torch.cuda.memory_reserved(0),
                      "free_left": torch.cuda.mem_get_info(0)[0],
                      "retries": torch.cuda.memory_stats(0).get("num_alloc_retries", 0)}
        globals().setdefault("_held", []).append(held)
    out["reserved_total"] = torch.cuda.memory_reserved(0)
    out["slack"] = free0 - (out["reserved_total"] - out["reserved_at_start"])
    return out


def context_growth() -> dict[str, Any]:
    """cudaMemGetInfo's free memory of a fresh process after each first: context, a kernel that allocates nothing,
    a fill, a top-k, a matrix product (its cuBLAS workspace goes through the caching allocator: reserved)."""
    import torch

    steps: list[dict[str, Any]] = []

    def note(what: str) -> None:
        torch.cuda.synchronize()
        steps.append({"after": what, "free": torch.cuda.mem_get_info(0)[0], "reserved": torch.cuda.memory_reserved(0)})

    torch.cuda.init()
    torch.cuda.set_device(0)
    note("context")
    torch.cuda._sleep(1000)
    note("sleep kernel")
    x = torch.empty(1 << 20, device="cuda:0")
    note("empty 4 MiB")
    x.fill_(1.0)
    note("fill")
    torch.topk(x.view(256, -1), 16)
    note("topk")
    a = torch.ones(1024, 1024, device="cuda:0")
    a @ a
    note("matmul")
    return {"steps": steps, "loading": os.environ.get("CUDA_MODULE_LOADING", ""),
            "has_get_fraction": hasattr(torch.cuda, "get_per_process_memory_fraction")}


def probe(state: str, tokens: int) -> dict[str, Any]:
    """Build the state; record the snapshot (tokens 0) or run one prefill of `tokens`."""
    import torch

    from telemetry.hook.allocator import cuda_memory_snapshot
    from telemetry.model.indexer.backends import CudaBackend
    from telemetry.model.indexer.prefill import run_prefill

    backend = CudaBackend(0)
    kept = STATES[state](backend)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info(0)
    start = backend.counters()
    out: dict[str, Any] = {"tokens": tokens, "state": state, "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                           "free": free, "start_reserved": start.reserved_bytes,
                           "start_allocated": start.allocated_bytes}
    if tokens == 0:
        out.update(snapshot=cuda_memory_snapshot(torch), total=total, device=torch.cuda.get_device_name(0),
                   torch=torch.__version__)
        return out
    torch.cuda.reset_peak_memory_stats(0)
    try:
        run_prefill(backend, shape(), "stock", tokens)
        torch.cuda.synchronize()
        oom = False
    except torch.OutOfMemoryError:
        oom = True
    stats = torch.cuda.memory_stats(0)
    out.update(out_of_memory=oom, peak_reserved=int(stats["reserved_bytes.all.peak"]),
               num_alloc_retries=int(stats.get("num_alloc_retries", 0)),
               num_device_alloc=int(stats.get("num_device_alloc", 0)))
    del kept
    return out


def run_child(conf: str, *args: str) -> dict[str, Any]:
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env, timeout=240)
    if done.returncode != 0:
        return {"error": done.stderr[-3000:]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


# ---- the search (this process never touches CUDA) ---------------------------------------------------------------

def predicted_edge(snapshot_probe: dict[str, Any], conf: str) -> int:
    from telemetry.model.allocsim.snapshot import read_allocator_state
    from telemetry.model.indexer.fit import max_prefill_tokens

    state = read_allocator_state(snapshot_probe["snapshot"], device=0)
    limit = state.counters.reserved_bytes + int(snapshot_probe["free"]) - ISSUE_SLACK
    return max_prefill_tokens(state, shape(), limit_bytes=limit, alloc_conf=conf,
                              total_memory=int(snapshot_probe["total"])).tokens


def search_edge(conf: str, state: str, guess: int, deadline: float) -> dict[str, Any]:
    """Fresh process per length: (longest that fits, first that runs out of memory), exact to the token."""
    top = SHAPE["max_model_len"]
    probes: dict[int, dict[str, Any]] = {}

    def fits(n: int) -> bool:
        result = run_child(conf, "--probe", state, str(n))
        probes[n] = result
        if "error" in result:
            raise RuntimeError(result["error"])
        print(f"    {state} {conf or 'defaults'} {n:>9,}: {'OOM' if result['out_of_memory'] else 'fits'}"
              f" (free {result['free']:,})", flush=True)
        return not result["out_of_memory"]

    lo: int | None = None
    hi: int | None = None
    n = min(max(guess, 1), top)
    try:
        if fits(n):
            lo = n
            if n < top:
                hi_or_lo = n + 1
                if fits(hi_or_lo):
                    lo = hi_or_lo
                else:
                    hi = hi_or_lo
        else:
            hi = n
            if n > 1:
                if fits(n - 1):
                    lo = n - 1
                else:
                    hi = n - 1
        step = 512
        while lo is None and hi is not None and hi > 1 and time.monotonic() < deadline:
            candidate = max(1, hi - step)
            if fits(candidate):
                lo = candidate
            else:
                hi = candidate
            step *= 2
        while hi is None and lo is not None and lo < top and time.monotonic() < deadline:
            candidate = min(top, lo + step)
            if fits(candidate):
                lo = candidate
            else:
                hi = candidate
            step *= 2
        while lo is not None and hi is not None and hi - lo > 1 and time.monotonic() < deadline:
            middle = (lo + hi) // 2
            if fits(middle):
                lo = middle
            else:
                hi = middle
    except RuntimeError as error:
        return {"longest_fit": lo, "first_oom": hi, "exact": False, "error": str(error)[-1500:],
                "probes": list(probes.values())}
    exact = lo is not None and (hi == lo + 1 or (hi is None and lo == top))
    return {"longest_fit": lo, "first_oom": hi, "exact": exact,
            "frees": sorted({p["free"] for p in probes.values() if "free" in p}), "probes": list(probes.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--free-gib", type=float, default=6.0)
    parser.add_argument("--states", default=",".join(STATES))
    parser.add_argument("--confs", default="default,expandable")
    parser.add_argument("--deadline-s", type=float, default=420.0)
    parser.add_argument("--skip-driver", action="store_true", help="do not measure the driver's slack again")
    parser.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--context", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.hold:
        hold(args.free_gib)
        return 0
    if args.driver:
        print(json.dumps(driver()))
        return 0
    if args.context:
        print(json.dumps(context_growth()))
        return 0
    if args.probe:
        print(json.dumps(probe(args.probe[0], int(args.probe[1]))))
        return 0
    if args.out is None:
        parser.error("--out DIR is required")
    deadline = time.monotonic() + args.deadline_s
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "shape": SHAPE,
                              "free_gib": args.free_gib, "driver": {}, "cases": {}}
    holder = subprocess.Popen([sys.executable, __file__, "--hold", "--free-gib", str(args.free_gib)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout is not None
        report["holder"] = json.loads(holder.stdout.readline())
        print(f"holder: {report['holder']}", flush=True)
        for loading in ("LAZY", "EAGER"):
            env_conf = {"CUDA_MODULE_LOADING": loading}
            os.environ.update(env_conf)
            report[f"context_{loading.lower()}"] = run_child("", "--context")
            print(f"context {loading}: {json.dumps(report[f'context_{loading.lower()}'])}", flush=True)
        os.environ.pop("CUDA_MODULE_LOADING", None)
        for name in args.confs.split(","):
            if args.skip_driver:
                break
            report["driver"][name] = run_child(CONFS[name], "--driver")
            print(f"driver {name}: {json.dumps(report['driver'][name])}", flush=True)
        path = args.out / "fit-edge.json"
        for state in args.states.split(","):
            for name in args.confs.split(","):
                if time.monotonic() > deadline:
                    break
                conf = CONFS[name]
                started = time.monotonic()
                snap = run_child(conf, "--probe", state, "0")
                if "error" in snap:
                    report["cases"][f"{state}/{name}"] = {"conf": conf, "error": snap["error"]}
                    print(f"{state}/{name}: state probe failed:\n{snap['error']}", flush=True)
                    continue
                guess = predicted_edge(snap, conf)
                found = search_edge(conf, state, guess, deadline)
                case = {"state": state, "conf": conf, "free": snap["free"], "total": snap["total"],
                        "start_reserved": snap["start_reserved"], "start_allocated": snap["start_allocated"],
                        "predicted_with_issue_slack": guess, **found, "snapshot": snap["snapshot"],
                        "device": snap["device"], "torch": snap["torch"],
                        "seconds": round(time.monotonic() - started, 1)}
                report["cases"][f"{state}/{name}"] = case
                print(f"{state}/{name}: free {snap['free']:,} reserved {snap['start_reserved']:,} | predicted "
                      f"{guess:,} | real edge {found['longest_fit']} / {found['first_oom']} exact={found['exact']} "
                      f"({case['seconds']} s, {len(found['probes'])} probes)", flush=True)
                path.write_text(json.dumps(report))
        path.write_text(json.dumps(report))
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        holder.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
