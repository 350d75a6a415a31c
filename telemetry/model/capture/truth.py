"""Record what the real CUDA caching allocator does, op by op, for the simulator's test fixtures.

Run on a machine with a GPU (torch with CUDA):

    PYTHONPATH=. python3 -m telemetry.model.capture.truth --out DIR

For every allocator config it starts one process with `PYTORCH_CUDA_ALLOC_CONF` set (PyTorch reads
the setting once per process) and writes `DIR/<gpu>-torch<version>-<config>.json` in the shared
truth format (../shared/data/allocator-truth/README.md): each case starts after `empty_cache()`
with nothing live; after every op the allocator's `reserved_bytes.all.current`,
`allocated_bytes.all.current`, `num_device_alloc` and `num_device_free`, relative to the values
before the case's first op. A `malloc` is `torch.empty(size, dtype=torch.uint8)`; `free` drops the
last reference. A malloc that runs out of memory (only with a memory fraction) records its row
and its id never becomes live.

Cases are generated from fixed seeds, so every config sees the same ops: random mixes of sizes
and frees with occasional `empty_cache`, sizes at the allocator's boundaries, the sparse
indexer's logits patterns (stock and fixed width, with and without top-k outputs and transients), and
many small segments at once (where the driver puts them: `--addresses` records every malloc's device
pointer and the process's /proc/self/maps, for the model in allocsim/driver_va.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from telemetry.allocator_counters import AllocatorCounters, read_cuda_counters

MIB = 1024 * 1024
CONFIGS = (
    "",
    "expandable_segments:True",
    "max_split_size_mb:256",
    "roundup_power2_divisions:4",
    "max_split_size_mb:256,roundup_power2_divisions:4",
    "expandable_segments:True,roundup_power2_divisions:4",
    "roundup_power2_divisions:[256:1,512:2,1024:4,>:8],max_split_size_mb:512,max_non_split_rounding_mb:64",
    "per_process_memory_fraction:0.05,garbage_collection_threshold:0.6",
)
LIVE_CAP_BYTES = 24 * 1024**3  # keep every case far below the device's memory


# ---- case generation (pure, seeded) -------------------------------------------------------


def _random_size(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.40:
        return rng.randint(1, MIB)
    if r < 0.65:
        return rng.randint(MIB + 1, 10 * MIB)
    if r < 0.90:
        return rng.randint(10 * MIB, 300 * MIB)
    return rng.randint(300 * MIB, 1200 * MIB)


def _edge_size(rng: random.Random) -> int:
    anchors = [512, MIB, 2 * MIB, 10 * MIB, 20 * MIB, 64 * MIB, 256 * MIB, 512 * MIB, 1024 * MIB]
    base = rng.choice(anchors) * rng.choice([1, 1, 1, 3])
    delta = rng.choice([-513, -512, -1, 0, 1, 511, 512, 513, MIB - 1, -MIB + 1, rng.randint(-2 * MIB, 2 * MIB)])
    return max(1, base + delta)


def _tie_size(rng: random.Random) -> int:
    # Few distinct sizes: many equal-size free blocks in different segments, where only the
    # order of device addresses decides which one the allocator reuses.
    return rng.choice([700_000, 1_049_087, 1_653_823, 3 * MIB + 5, 12 * MIB + 1, 25 * MIB - 3, 130 * MIB + 7])


def random_case(seed: int, n_ops: int, size_fn: Callable[[random.Random], int], *, max_live: int = 60,
                empty_every: float = 0.01) -> list[list[Any]]:
    rng = random.Random(seed)
    ops: list[list[Any]] = []
    live: dict[int, int] = {}
    next_id = 0
    while len(ops) < n_ops:
        r = rng.random()
        if r < empty_every:
            ops.append(["empty_cache"])
            continue
        want_free = live and (len(live) >= max_live or rng.random() < 0.45)
        if want_free:
            ident = rng.choice(list(live))
            del live[ident]
            ops.append(["free", ident])
            continue
        size = size_fn(rng)
        if sum(live.values()) + size > LIVE_CAP_BYTES:
            continue
        live[next_id] = size
        ops.append(["malloc", next_id, size])
        next_id += 1
    for ident in list(live):
        ops.append(["free", ident])
    return ops


def small_segments_case() -> list[list[Any]]:
    """Many small and 20 MiB segments at once, then holes among them: where the driver puts them."""
    ops: list[list[Any]] = []
    small = list(range(0, 100))  # 1 MiB each: two per 2 MiB segment, 50 segments
    mid = list(range(100, 110))  # 9 MiB each: two per 20 MiB segment, 5 segments
    ops += [["malloc", i, MIB] for i in small]
    ops += [["malloc", i, 9 * MIB] for i in mid]
    ops += [["free", i] for i in small[:50]] + [["free", i] for i in mid[:4]]
    ops.append(["empty_cache"])  # 25 small and 2 mid segments go back to the driver
    sizes = [300 * MIB + 1, 30 * MIB, 3 * MIB] + [MIB] * 30 + [9 * MIB] * 4 + [70 * MIB - 5, 5 * MIB]
    ops += [["malloc", 200 + k, size] for k, size in enumerate(sizes)]
    ops += [["free", i] for i in small[50:] + mid[4:]] + [["free", 200 + k] for k in range(len(sizes))]
    return ops


def indexer_case(mode: str, *, tokens: int, chunk: int, layers: int, topk: int = 0, transient_mb: float = 0.0,
                 keep_previous: bool = True, max_model_len: int = 204_800) -> list[list[Any]]:
    """The launch loop's op sequence for one arm (`memtel replay`'s `arm_ops`: the one loop, run_prefill)."""
    from telemetry.model.indexer.planner import check_mode
    from telemetry.model.indexer.prefill import LaunchPattern
    from telemetry.model.indexer.replay import ArmSpec, ReplayParams, arm_ops
    from telemetry.model.indexer.shape import IndexerShape

    shape = IndexerShape(layers=layers, chunk=chunk, max_model_len=max_model_len, topk=topk)
    pattern = LaunchPattern(keep_previous=keep_previous, transient_bytes=int(transient_mb * MIB))
    return [list(op) for op in arm_ops(ReplayParams(shape, tokens, pattern), ArmSpec(check_mode(mode)))]


def build_cases() -> dict[str, list[list[Any]]]:
    small: dict[str, Any] = {"tokens": 49_152, "chunk": 8192, "layers": 8}
    return {
        "random_mixed_a": random_case(11, 800, _random_size),
        "random_mixed_b": random_case(12, 800, _random_size, max_live=25, empty_every=0.02),
        "random_edges": random_case(13, 700, _edge_size, max_live=40, empty_every=0.02),
        "random_ties": random_case(14, 700, _tie_size, max_live=30, empty_every=0.01),
        "indexer_stock": indexer_case("stock", **small),
        "indexer_fixed": indexer_case("fixed", **small),
        "indexer_stock_topk_transient": indexer_case("stock", topk=2048, transient_mb=3.0, **small),
        "indexer_fixed_no_keep": indexer_case("fixed", keep_previous=False, chunk=4608, tokens=27_648, layers=6,
                                              max_model_len=409_600),
        "small_segments": small_segments_case(),
    }


# ---- the worker: one config, one process ---------------------------------------------------


def _counters() -> AllocatorCounters:
    counters = read_cuda_counters()
    if counters is None:
        raise RuntimeError("cannot read the CUDA caching allocator's counters (CUDA not initialised?)")
    return counters


def run_case(torch: Any, ops: list[list[Any]],
             addresses: list[int] | None = None) -> tuple[list[list[Any]], list[list[int]]]:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = _counters()
    live: dict[int, Any] = {}
    after: list[list[int]] = []
    for op in ops:
        if op[0] == "malloc":
            try:
                live[op[1]] = torch.empty(op[2], dtype=torch.uint8, device="cuda")
                if addresses is not None:
                    addresses.append(live[op[1]].data_ptr())
            except torch.cuda.OutOfMemoryError:
                if addresses is not None:
                    addresses.append(0)
        elif op[0] == "free":
            live.pop(op[1], None)
        else:
            torch.cuda.empty_cache()
        after.append(_counters().minus(base).row())
    live.clear()
    return ops, after


def _process_maps(label: str) -> str:
    try:
        return f"# /proc/self/maps {label}\n" + Path("/proc/self/maps").read_text()
    except OSError as exc:
        return f"# /proc/self/maps {label}: unreadable ({exc})\n"


def worker(config: str, out: Path, with_addresses: bool = False) -> int:
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")  # context and the first small segment, before any case
    props = torch.cuda.get_device_properties(0)
    cases = {}
    addresses: dict[str, list[int]] = {}
    maps: list[str] = []
    for name, ops in build_cases().items():
        if with_addresses and not maps:
            maps.append(_process_maps("before the first case"))
        addresses[name] = []
        ops, after = run_case(torch, ops, addresses[name] if with_addresses else None)
        cases[name] = {"ops": ops, "after": after}
    if with_addresses:
        # Diagnostics, beside the truth file: the device address of every malloc (0: out of memory).
        out.with_suffix(".addresses.json").write_text(json.dumps(addresses, separators=(",", ":")))
        maps.append(_process_maps("after the last case"))  # where the driver put the segments
        out.with_suffix(".maps.txt").write_text("".join(maps))
    doc = {
        "config": config,
        "torch": torch.__version__,
        "device": f"{props.name} (discrete, {props.total_memory / 1e9:.0f} GB; "
                  f"total_memory {props.total_memory} bytes)",
        "cases": cases,
    }
    out.write_text(json.dumps(doc, separators=(",", ":")))
    return 0


def config_slug(config: str) -> str:
    if not config:
        return "default"
    return re.sub(r"[^A-Za-z0-9.]+", "-", config).strip("-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the truth files")
    parser.add_argument("--config", action="append", default=None,
                        help="allocator configs (default: the built-in list)")
    parser.add_argument("--addresses", action="store_true",
                        help="also write each malloc's device address beside each file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), args.file, args.addresses)
    args.out.mkdir(parents=True, exist_ok=True)
    failures = 0
    for config in args.config or CONFIGS:
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=config)
        env.pop("PYTORCH_ALLOC_CONF", None)
        path = args.out / f"h200-torch-{config_slug(config)}.json"
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "telemetry.model.capture.truth", "--out", str(args.out), "--worker",
             "--file", str(path)]
            + (["--addresses"] if args.addresses else []),
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        took = time.perf_counter() - started
        if done.returncode != 0:
            failures += 1
            print(f"FAILED {config!r} ({took:.1f}s): {done.stderr.strip()[-1500:]}", flush=True)
        else:
            print(f"wrote {path} ({path.stat().st_size} bytes, {took:.1f}s) for {config!r}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
