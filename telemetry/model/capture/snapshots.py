"""Record allocator truth from live processes, for the seeded simulator, `forecast` and `whatif`.

Run on a machine with a GPU (torch with CUDA):

    PYTHONPATH=. python3 -m telemetry.model.capture.snapshots --out DIR

Two kinds of capture, each process with its own `PYTORCH_CUDA_ALLOC_CONF` (read once per process):

1. Seeded (`seeded-<config>-<mode>.*`): a process builds allocator state (resident "weights",
   a stock indexer prefill, a KV-cache block and activations, some of them freed), saves
   `torch.cuda.memory_snapshot()` as JSON and `torch.cuda.memory._snapshot()` as a pickle (both
   gzip), then runs the next prefill's logits launches (the launch loop's ops for `mode`) and
   records the allocator's counters after every op relative to the snapshot, in the allocator-truth
   format (`cases.next_prefill.ops` / `after`), with each malloc's device pointer.
2. What-if (`whatif-*`): one workload of real torch ops (transformer layers at varying sequence
   lengths with growing indexer-style logits and their top-k; an `empty_cache()` after the longest
   requests) run (a) with `torch.cuda.memory._record_memory_history()` under the defaults, dumped
   with `_dump_snapshot()`; (b) the same with a small `max_entries` ring (an incomplete history);
   (c) without recording under each setting of `WHATIF_SETTINGS` (the garbage-collection one with
   `torch.cuda.set_per_process_memory_fraction`, sized from the default run's peak). Every run reads
   the counters at the same checkpoints (after each request, where the recorded run takes a
   snapshot, and at the end), so `whatif` can be checked at every checkpoint of every setting, and
   the recorded run's counters against the unrecorded default run's.

`--dry-run` runs every step on the CPU with the simulator standing in for CUDA (tiny real-op
workload, counters from the simulator): it checks the script and its files before GPU time is spent.
Everything is written to DIR and packed into DIR/captures.tar.gz.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import pickle
import random
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

MIB = 1024 * 1024
SEEDED_CONFIGS = ("", "expandable_segments:True", "max_split_size_mb:256,roundup_power2_divisions:4")
MODES = ("stock", "fixed")
STATE_SHAPE = {"layers": 8, "chunk": 8192}
STATE_TOKENS = (24_576, 65_536)  # the earlier prefill: shorter than the next one (it grows), or as long as the budget
NEXT_SHAPE = {"layers": 12, "chunk": 8192, "tokens": 131_072, "max_model_len": 204_800}
WHATIF_SETTINGS = ("", "expandable_segments:True", "max_split_size_mb:256", "roundup_power2_divisions:4")
GC_THRESHOLD = 0.6
GC_HEADROOM = 1.2  # the memory fraction allows this much more than the default run's peak reserved
RING_ENTRIES = 1500
WORKLOAD = {"hidden": 1024, "heads": 8, "layers": 4, "chunk": 8192, "ratio": 4, "topk": 256,
            "seqs": [3000, 12000, 30000, 6000, 52000, 20000, 8000, 65536], "empty_cache_after": [4, 7]}
DRY_WORKLOAD = {"hidden": 64, "heads": 4, "layers": 2, "chunk": 256, "ratio": 4, "topk": 8,
                "seqs": [100, 400, 900, 300, 1500, 600], "empty_cache_after": [4]}


def slug(config: str) -> str:
    from telemetry.model.capture.truth import config_slug

    return config_slug(config)


# ---- op lists (pure, seeded) -----------------------------------------------------------------


def prefill_ops(mode: str, tokens: int, chunk: int, layers: int, max_model_len: int = 204_800) -> list[list[Any]]:
    """The launch loop's ops for one prefill (telemetry.model.indexer.prefill.run_prefill)."""
    from telemetry.model.capture.truth import indexer_case

    return indexer_case(mode, tokens=tokens, chunk=chunk, layers=layers, max_model_len=max_model_len)


def state_ops(state_tokens: int, seed: int = 21) -> list[list[Any]]:
    """Allocator state of a serving process: weights, a stock prefill that left its segments cached,
    a KV-cache block, activations with holes. Ids: weights 0.., prefill 100000.., the rest 200000.."""
    rng = random.Random(seed)
    ops: list[list[Any]] = []
    for ident in range(40):
        r = rng.random()
        size = (rng.randint(1000, MIB) if r < 0.4 else rng.randint(MIB, 20 * MIB) if r < 0.7
                else rng.randint(20 * MIB, 400 * MIB))
        ops.append(["malloc", ident, size])
    for op in prefill_ops("stock", tokens=state_tokens, **STATE_SHAPE):
        ops.append([op[0], op[1] + 100_000, *op[2:]])
    ops.append(["malloc", 200_000, 3 * 1024 * MIB])  # a KV cache
    activations = []
    for k in range(1, 31):
        r = rng.random()
        size = (rng.randint(1000, MIB) if r < 0.3 else rng.randint(MIB, 16 * MIB) if r < 0.8
                else rng.randint(16 * MIB, 96 * MIB))
        ops.append(["malloc", 200_000 + k, size])
        activations.append(200_000 + k)
    for ident in activations[::3]:
        ops.append(["free", ident])
    return ops


# ---- where allocations go: CUDA, or the simulator for a dry run ------------------------------


class CudaAllocator:
    def __init__(self) -> None:
        import torch

        self.torch = torch
        torch.cuda.init()
        self.device = torch.device("cuda", torch.cuda.current_device())
        torch.empty(1, device=self.device)  # the context and torch's first small segment, as a process has them

    def alloc(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.device)

    def pointer(self, allocation: Any) -> int:
        return int(allocation.data_ptr())

    def counters(self) -> list[int]:
        s = self.torch.cuda.memory_stats(self.device)
        return [int(s.get(k, 0)) for k in ("reserved_bytes.all.current", "allocated_bytes.all.current",
                                            "num_device_alloc", "num_device_free")]

    def memory_snapshot(self) -> Any:
        return self.torch.cuda.memory_snapshot()

    def full_snapshot(self) -> Any:
        return self.torch.cuda.memory._snapshot()

    def describe(self) -> dict[str, Any]:
        props = self.torch.cuda.get_device_properties(self.device)
        return {"torch": self.torch.__version__, "device": props.name, "total_memory": int(props.total_memory)}


class SimAllocator:
    """Dry run: the simulator stands in for the CUDA allocator (same files, simulated numbers)."""

    def __init__(self, config: str) -> None:
        from telemetry.model.allocsim.recorder import RecordingSim

        self.rec = RecordingSim(config)
        self.first = self.rec.malloc(1)  # dropped at once, as the CUDA path's first tensor

    def alloc(self, nbytes: int) -> Any:
        return self.rec.malloc(nbytes)

    def free(self, handle: Any) -> None:
        self.rec.free(handle)

    def pointer(self, handle: Any) -> int:
        block = self.rec.sim._live[handle]
        return block.addr if block is not None else 0

    def counters(self) -> list[int]:
        return self.rec.counters()

    def memory_snapshot(self) -> Any:
        return self.rec.sim.snapshot()

    def full_snapshot(self) -> Any:
        doc = self.rec.dump()
        doc["device_traces"] = [[]]  # no history was recorded
        return doc

    def describe(self) -> dict[str, Any]:
        from telemetry.model.allocsim.simulator import DEFAULT_TOTAL_MEMORY

        return {"torch": "dry run (simulator)", "device": "simulator", "total_memory": DEFAULT_TOTAL_MEMORY}


def _readable(path: Path) -> str | None:
    """None if memtel's own reader takes the file (no code runs), else why not: checked where it was made."""
    from telemetry.model.allocsim.snapshot_file import read_snapshot_file

    try:
        read_snapshot_file(path)
    except Exception as exc:  # recorded for the report, never fatal to the capture
        return f"{type(exc).__name__}: {exc}"
    return None


def _release(allocator: Any, allocation: Any) -> None:
    if isinstance(allocator, SimAllocator):
        allocator.free(allocation)
    # CUDA: the caller dropped the only other reference; this one goes when the function returns


# ---- workers -----------------------------------------------------------------------------------


def seeded_worker(config: str, mode: str, state_tokens: int, out: Path, dry_run: bool) -> None:
    allocator: Any = SimAllocator(config) if dry_run else CudaAllocator()
    if dry_run:
        allocator.free(allocator.first)
    live: dict[int, Any] = {}
    for op in state_ops(state_tokens):
        if op[0] == "malloc":
            live[op[1]] = allocator.alloc(op[2])
        else:
            _release(allocator, live.pop(op[1]))
    stem = out / f"seeded-{slug(config)}-{mode}-state{state_tokens // 1024}k"
    segments = allocator.memory_snapshot()
    unusual: list[str] = []

    def plain(value: Any) -> Any:  # anything JSON cannot hold is named in the capture, not fatal
        unusual.append(type(value).__name__)
        return repr(value)

    with gzip.open(stem.with_suffix(".snapshot.json.gz"), "wt") as text:
        json.dump(segments, text, separators=(",", ":"), default=plain)
    with gzip.open(stem.with_suffix(".snapshot.pickle.gz"), "wb") as binary:
        pickle.dump(allocator.full_snapshot(), binary)
    readable = {kind: _readable(stem.with_suffix(f".snapshot.{kind}.gz")) for kind in ("json", "pickle")}
    base = allocator.counters()
    ops = prefill_ops(mode, **NEXT_SHAPE)
    after: list[list[int]] = []
    pointers: list[int] = []
    prefill: dict[int, Any] = {}
    for op in ops:
        if op[0] == "malloc":
            prefill[op[1]] = allocator.alloc(op[2])
            pointers.append(allocator.pointer(prefill[op[1]]))
        else:
            _release(allocator, prefill.pop(op[1]))
        now = allocator.counters()
        after.append([now[i] - base[i] for i in range(4)])
    doc = {"config": config, **allocator.describe(), "mode": mode, "state_base": base,
           "state_prefill": {"mode": "stock", "tokens": state_tokens, **STATE_SHAPE},
           "next_prefill": {"mode": mode, **NEXT_SHAPE},
           "snapshot": {"json": stem.with_suffix(".snapshot.json.gz").name,
                        "pickle": stem.with_suffix(".snapshot.pickle.gz").name},
           "cases": {"next_prefill": {"ops": ops, "after": after}}, "pointers": pointers,
           "unusual_types": sorted(set(unusual)), "reader_errors": readable}
    stem.with_suffix(".json").write_text(json.dumps(doc, separators=(",", ":")))


def run_workload(torch: Any, device: Any, params: dict[str, Any], checkpoint: Any) -> None:
    """Transformer layers over requests of varying length, with the indexer's growing logits."""
    import torch.nn.functional as F

    hidden, heads, layers = params["hidden"], params["heads"], params["layers"]
    chunk, ratio, topk = params["chunk"], params["ratio"], params["topk"]
    generator = torch.Generator(device=device).manual_seed(5)
    dtype = torch.float16 if device.type == "cuda" else torch.float32

    def weight(rows: int, cols: int) -> Any:
        return torch.randn(rows, cols, device=device, dtype=dtype, generator=generator) / math.sqrt(rows)

    weights = [(weight(hidden, 3 * hidden), weight(hidden, hidden), weight(hidden, 4 * hidden),
                weight(4 * hidden, hidden)) for _ in range(layers)]
    for number, seq in enumerate(params["seqs"]):
        x = torch.randn(seq, hidden, device=device, dtype=dtype, generator=generator)
        for w_qkv, w_o, w_up, w_down in weights:
            qkv = x @ w_qkv
            q, k, v = (t.reshape(seq, heads, hidden // heads).transpose(0, 1) for t in qkv.split(hidden, dim=1))
            for start in range(0, seq, chunk):
                rows = min(chunk, seq - start)
                kv = max(1, (start + rows) // ratio)
                logits = torch.empty((rows, kv), dtype=torch.float32, device=device)
                logits.fill_(1.0)
                top = torch.topk(logits, k=min(topk, kv), dim=1)
                del logits, top
            attention = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True)
            x = x + attention[0].transpose(0, 1).reshape(seq, hidden) @ w_o
            x = x + F.gelu(x @ w_up) @ w_down
            del qkv, q, k, v, attention
        float(x.float().sum())  # waits for the device
        del x
        if number in params["empty_cache_after"] and device.type == "cuda":
            torch.cuda.empty_cache()
        checkpoint()
    del weights


def whatif_worker(kind: str, config: str, out: Path, params: dict[str, Any], fraction: float | None,
                  dry_run: bool) -> None:
    import torch

    if dry_run:
        device = torch.device("cpu")
        info: dict[str, Any] = {"torch": torch.__version__ + " (dry run on the CPU)", "device": "cpu",
                                "total_memory": 0}

        def counters() -> list[int]:
            return [0, 0, 0, 0]
    else:
        torch.cuda.init()
        device = torch.device("cuda", torch.cuda.current_device())
        props = torch.cuda.get_device_properties(device)
        info = {"torch": torch.__version__, "device": props.name, "total_memory": int(props.total_memory)}

        def counters() -> list[int]:
            s = torch.cuda.memory_stats(device)
            return [int(s.get(k, 0)) for k in ("reserved_bytes.all.current", "allocated_bytes.all.current",
                                                "num_device_alloc", "num_device_free")]

        if fraction is not None:
            torch.cuda.set_per_process_memory_fraction(fraction, device)
    recording = kind in ("recorded", "ring") and not dry_run
    if recording:
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python",
                                                 max_entries=RING_ENTRIES if kind == "ring" else 10_000_000)
    base = counters()
    rows: list[list[int]] = []
    positions: list[int] = []
    peak = [0]

    def checkpoint() -> None:
        if recording:
            # Records a `snapshot` event: the checkpoint in the history (its position kept for diagnosis).
            positions.append(len(torch.cuda.memory._snapshot()["device_traces"][device.index or 0]))
        now = counters()
        rows.append([now[i] - base[i] for i in range(4)])
        if not dry_run:
            peak[0] = max(peak[0], int(torch.cuda.memory_stats(device).get("reserved_bytes.all.peak", 0)) - base[0])

    started = time.perf_counter()
    run_workload(torch, device, params, checkpoint)
    now = counters()
    rows.append([now[i] - base[i] for i in range(4)])  # where the dump's own snapshot event is
    name = f"whatif-{kind}" if kind != "setting" else f"whatif-setting-{slug(config)}"
    readable = None
    if recording:
        with gzip.open(out / f"{name}.pickle.gz", "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        torch.cuda.memory._record_memory_history(enabled=None)
        readable = _readable(out / f"{name}.pickle.gz")
    elif dry_run and kind in ("recorded", "ring"):
        from telemetry.model.allocsim.recorder import RecordingSim

        rec = RecordingSim(config)
        for _ in params["seqs"]:
            rec.free(rec.malloc(3 * MIB))
            rec.snapshot()
        with gzip.open(out / f"{name}.pickle.gz", "wb") as f:
            pickle.dump(rec.dump(), f)
    doc = {"kind": kind, "config": config, "fraction": fraction, **info, "base": base, "checkpoints": rows,
           "peak_reserved": peak[0], "seconds": round(time.perf_counter() - started, 2),
           "trace_positions": positions, "reader_error": readable}
    (out / f"{name}.json").write_text(json.dumps(doc))


def timing_worker(out: Path, dry_run: bool) -> None:
    """What a forecast costs in a process holding many segments: snapshot, read, seed and simulate."""
    from telemetry.model.allocsim.snapshot import read_allocator_state
    from telemetry.model.indexer.forecast import forecast
    from telemetry.model.indexer.shape import REFERENCE_SHAPE

    allocator: Any = SimAllocator("") if dry_run else CudaAllocator()
    rng = random.Random(9)
    held: list[Any] = []
    rows = []
    for target in (556, 5000):
        while len(allocator.memory_snapshot()) < target:
            # Mostly small-pool blocks (two per 2 MiB segment), some 10-40 MiB ones: a few GiB in all.
            batch = min(200, target - len(allocator.memory_snapshot()))
            held += [allocator.alloc(rng.randint(10, 40) * MIB - rng.randint(0, MIB) if rng.random() < 0.05
                                     else rng.randint(MIB // 2 + 1, MIB)) for _ in range(batch)]
        timings: dict[str, list[float]] = {"snapshot": [], "read": []}
        for _ in range(5):
            started = time.perf_counter()
            segments = allocator.memory_snapshot()
            timings["snapshot"].append(time.perf_counter() - started)
            started = time.perf_counter()
            state = read_allocator_state(segments)
            timings["read"].append(time.perf_counter() - started)
        for tokens in (100_000, 200_000):
            key = f"forecast_{tokens}"
            timings[key] = []
            for _ in range(3):
                started = time.perf_counter()
                result = forecast(state, REFERENCE_SHAPE, tokens)
                timings[key].append(time.perf_counter() - started)
        rows.append({"segments": len(segments), "best_seconds": {k: min(v) for k, v in timings.items()},
                     "growth_200k": result.reserved_growth_bytes})
    (out / "timing.json").write_text(json.dumps({**allocator.describe(), "cpu": os.cpu_count(), "rows": rows}))


# ---- the parent: one process per configuration -------------------------------------------------


def run_worker(module: str, args: list[str], config: str, log: list[str]) -> bool:
    """`python -m module ARGS` in a fresh process under PYTORCH_CUDA_ALLOC_CONF=`config` (allocator settings are
    read once per process); one line per run, printed and kept in `log`. True when it exited 0."""
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=config)
    env.pop("PYTORCH_ALLOC_CONF", None)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True, text=True, check=False)
    line = f"{'ok' if done.returncode == 0 else 'FAILED'} {args} {config!r} {time.perf_counter() - started:.1f}s"
    if done.returncode:
        line += ": " + done.stderr.strip()[-1500:]
    print(line, flush=True)
    log.append(line)
    return done.returncode == 0


def _run(args: list[str], config: str, log: list[str]) -> bool:
    return run_worker("telemetry.model.capture.snapshots", args, config, log)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU only: the simulator stands in for CUDA")
    parser.add_argument("--only", choices=("seeded", "whatif", "timing"), default=None)
    parser.add_argument("--small", action="store_true", help="the dry run's small workload, on CUDA (GPU tests)")
    parser.add_argument("--worker", choices=("seeded", "recorded", "ring", "setting", "timing"), help=argparse.SUPPRESS)
    parser.add_argument("--state-tokens", type=int, default=STATE_TOKENS[0], help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, default="stock", help=argparse.SUPPRESS)
    parser.add_argument("--fraction", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out = args.out
    config = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    params = DRY_WORKLOAD if args.dry_run or args.small else WORKLOAD
    if args.worker == "seeded":
        seeded_worker(config, args.mode, args.state_tokens, out, args.dry_run)
        return 0
    if args.worker == "timing":
        timing_worker(out, args.dry_run)
        return 0
    if args.worker:
        whatif_worker(args.worker, config, out, params, args.fraction, args.dry_run)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    dry = ["--dry-run"] if args.dry_run else []
    log: list[str] = []
    ok = True
    if args.only in (None, "whatif"):
        for kind in ("recorded", "ring"):
            ok &= _run(["--worker", kind, "--out", str(out), *dry], "", log)
        for setting in WHATIF_SETTINGS:
            ok &= _run(["--worker", "setting", "--out", str(out), *dry], setting, log)
        default = json.loads((out / f"whatif-setting-{slug('')}.json").read_text()) if ok else None
        if default is not None:
            total = default["total_memory"] or 150_109_880_320
            fraction = math.ceil(GC_HEADROOM * max(default["peak_reserved"], 1) / total * 10_000) / 10_000
            gc_config = f"garbage_collection_threshold:{GC_THRESHOLD}"
            ok &= _run(["--worker", "setting", "--fraction", str(fraction), "--out", str(out), *dry], gc_config, log)
    if args.only in (None, "seeded"):
        for setting in SEEDED_CONFIGS:
            for tokens in STATE_TOKENS:
                for mode in MODES:
                    ok &= _run(["--worker", "seeded", "--mode", mode, "--state-tokens", str(tokens), "--out", str(out),
                                *dry], setting, log)
    if args.only in (None, "timing"):
        ok &= _run(["--worker", "timing", "--out", str(out), *dry], "", log)
    (out / "capture.log").write_text("\n".join(log) + "\n")
    with tarfile.open(out / "captures.tar.gz", "w:gz") as tar:
        for path in sorted(out.iterdir()):
            if path.name != "captures.tar.gz":
                tar.add(path, arcname=path.name)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
