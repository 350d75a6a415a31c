"""What `memtel tune`'s search costs: CPU time of the whole search from an allocator state of N segments.

    PYTHONPATH=. python benchmarks/tune_bench.py [--segments 556] [--spare-gb -1.8,0.3] [--max-model-len 204800]
                                                 [--target-tokens 131072] [--snapshot FILE] [--layers 45]
                                                 [--chunk 8192] [--budget-mb 512] [--topk 0] [--profile FILE]
                                                 [--history] [--cap device|fraction] [--total-memory-gb 139.8]

The state (unless --snapshot): forecast_bench.py's, made on the simulator from nothing: N segments, alternately
a small-pool one (two 1 MiB blocks) and a large one (one block of 10-16 MiB), half of them freed (cached, free).
The shape: the reference (45 layers, 8,192-token chunks, ratio 4, 512 MiB budget, no top-k) unless given,
max-model-len as given.
The memory: the state's reserved bytes plus --spare-gb (negative: below it, so the cache must be freed).
The space: `memtel tune`'s default (720 settings; under `--cap fraction` garbage_collection_threshold too: 2,160).
`--history`: the synthetic state's own allocation history (how it was made, op by op) is replayed under each
setting (telemetry/model/fitsearch/history.py), as `memtel tune --history` does.
Prints one line per memory and a JSON document at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIB = 1 << 20
GIB = 1 << 30


def synthetic_state(segments: int) -> tuple[Any, Any]:
    """(the state, its history as ops)."""
    from telemetry.model.allocsim.snapshot import read_allocator_state
    from telemetry.model.fitsearch.history import history_from_ops
    from telemetry.model.indexer.backends import SimBackend

    backend = SimBackend("")
    ops: list[list[Any]] = []

    def alloc(nbytes: int) -> Any:
        handle = backend.alloc(nbytes)
        ops.append(["a", id(handle), nbytes])
        return handle

    def release(handle: Any) -> None:
        ops.append(["f", id(handle)])
        backend.release(handle)

    slots = [[alloc(MIB), alloc(MIB)] if i % 2 else [alloc((10 + 2 * (i // 2 % 4)) * MIB)] for i in range(segments)]
    for i, blocks in enumerate(slots):
        if i % 4 >= 2:
            for block in blocks:
                release(block)
    return read_allocator_state(backend.snapshot()), history_from_ops(ops, source="the synthetic state's history")


def one(state: Any, shape: Any, spare_gb: float, target: int, top: int, history: Any = None, cap: str = "device",
        total: int | None = None) -> dict[str, Any]:
    from telemetry.model.fitsearch.search import Problem, tune
    from telemetry.model.fitsearch.space import SearchSpace, expand, process_setting

    limit = state.counters.reserved_bytes + int(spare_gb * GIB)
    problem = Problem(state, shape, limit, target, history=history, cap=cap, total_memory=total)
    wall = time.perf_counter()
    cpu = time.process_time()
    expanded = expand(SearchSpace(), shape, state.alloc_conf or "", fraction_applies=cap == "fraction")
    result = tune(problem, expanded, process_setting(shape, state.alloc_conf or "", "stock"), top=top)
    return {"spare_gb": spare_gb, "limit_bytes": limit, "settings": result.settings, "in_full": len(result.ranked),
            "ruled_out": len(result.pruned), "simulations": result.simulations,
            "cpu_s": round(time.process_time() - cpu, 2), "wall_s": round(time.perf_counter() - wall, 2),
            "best": result.best.setting.label(), "best_fit": result.best.fit_tokens,
            "process_fit": result.process.fit_tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--segments", type=int, default=556)
    parser.add_argument("--snapshot", type=Path, default=None, help="a snapshot file instead of the synthetic state")
    parser.add_argument("--spare-gb", default="-1.8,0.3", help="memory beyond the state's reserved bytes, GiB")
    parser.add_argument("--max-model-len", type=int, default=204_800)
    parser.add_argument("--layers", type=int, default=45)
    parser.add_argument("--target-tokens", type=int, default=131_072)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--budget-mb", type=int, default=512)
    parser.add_argument("--topk", type=int, default=0)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--profile", type=Path, default=None, help="write cProfile stats of the searches here")
    parser.add_argument("--history", action="store_true", help="replay the synthetic state's history per setting")
    parser.add_argument("--cap", choices=("device", "fraction"), default="device")
    parser.add_argument("--total-memory-gb", type=float, default=139.8, help="the fraction's base under --cap fraction")
    args = parser.parse_args(argv)
    from telemetry.model.allocsim.snapshot import load_allocator_state
    from telemetry.model.indexer.shape import REFERENCE_SHAPE

    if args.snapshot:
        if args.history:
            parser.error("--history replays the synthetic state's own history: leave out --snapshot")
        state, history = load_allocator_state(args.snapshot), None
    else:
        state, history = synthetic_state(args.segments)
        history = history if args.history else None
    total = int(args.total_memory_gb * GIB) if args.cap == "fraction" else None
    shape = dataclasses.replace(REFERENCE_SHAPE, max_model_len=args.max_model_len, layers=args.layers, chunk=args.chunk,
                                logits_budget_bytes=args.budget_mb * MIB, topk=args.topk)
    print(f"state: {len(state.segments)} segments, {state.live_blocks()} live blocks, "
          f"{state.counters.reserved_bytes / MIB:,.0f} MiB reserved; shape {shape}", flush=True)
    rows = []
    profiler = None
    if args.profile is not None:
        import cProfile

        profiler = cProfile.Profile()
    for spare in (float(x) for x in args.spare_gb.split(",")):
        if profiler is not None:
            profiler.enable()
        row = one(state, shape, spare, args.target_tokens, args.top, history, args.cap, total)
        if profiler is not None:
            profiler.disable()
        rows.append(row)
        print(f"spare {spare:+g} GiB: {row['settings']} settings, {row['in_full']} in full, {row['ruled_out']} ruled "
              f"out, {row['simulations']:,} simulated prefills, {row['cpu_s']} s CPU ({row['wall_s']} s wall); best "
              f"{row['best_fit']:,} tokens ({row['best']}), today {row['process_fit']:,}", flush=True)
    if profiler is not None:
        profiler.dump_stats(args.profile)
    print(json.dumps({"segments": len(state.segments), "shape": dataclasses.asdict(shape), "cap": args.cap,
                      "history_ops": None if history is None else len(history.ops), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
