"""Throughput of the caching-allocator simulator, at scale, and of what runs on it.

    .venv/bin/python benchmarks/allocsim_bench.py [--repeat 3] [--only NAME ...]

Sections (`--only` picks some): `truth` (every captured truth file replayed, rows compared),
`stream` (a synthetic 200,000-op random stream on an empty allocator), `scale` (the same stream on an
allocator seeded with 10^3, 10^4 and 10^5 live segments, against the empty-allocator rate; and N
live mallocs that each need a new segment, the issue's quadratic case), `replay` (the 98,304-token,
45-layer `memtel replay`, both arms), `whatif` (a synthetic 10^6-event recorded history: unpickle,
read, replay per setting), `forecast` (`forecast()` from states of 556 and 5,000 segments).
Targets (issues 4 and 12): >= 200,000 simulated ops/s; the 98k replay well under a second; every op
O(log n): at 10^5 live segments within 2x of the empty-allocator rate; 10^6 trace events in seconds.
"""

from __future__ import annotations

import argparse
import json
import pickle
import platform
import random
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from telemetry.model.allocsim import CachingAllocatorSim
from telemetry.model.allocsim.ops import replay_cases, replay_ops
from telemetry.model.allocsim.snapshot import read_allocator_state, seeded_simulator

REPO = Path(__file__).resolve().parents[1]
TRUTH_DIRS = [REPO / "tests" / "fixtures" / "allocator-truth", REPO.parent / "shared" / "data" / "allocator-truth"]
MIB = 1024 * 1024
SECTIONS = ("truth", "stream", "scale", "replay", "whatif", "forecast")


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def synthetic_ops(n: int, seed: int = 7) -> list[list[Any]]:
    rng = random.Random(seed)
    ops: list[list[Any]] = []
    live: list[int] = []
    next_id = 0
    while len(ops) < n:
        if live and (len(live) > 50 or rng.random() < 0.5):
            ops.append(["free", live.pop(rng.randrange(len(live)))])
        else:
            size = rng.choice([rng.randint(1, 2**20), rng.randint(2**20, 2**24), rng.randint(2**24, 2**29)])
            ops.append(["malloc", next_id, size])
            live.append(next_id)
            next_id += 1
    return ops


def synthetic_snapshot(segments: int, seed: int = 3) -> list[dict[str, Any]]:
    """`segments` live segments as memory_snapshot() lists them: each with a live block and a free tail."""
    rng = random.Random(seed)
    out = []
    address = 0x7F00_0000_0000
    for _ in range(segments):
        if rng.random() < 0.3:
            total, live = 2 * MIB, rng.randint(1, 2048) * 512
            kind = "small"
        else:
            total = rng.randint(10, 400) * 2 * MIB
            live = total - rng.randint(2, 2048) * 1024 * 2
            kind = "large"
        address -= total + rng.choice([0, 0, 30 * MIB])
        blocks = [{"address": address, "size": live, "state": "active_allocated"},
                  {"address": address + live, "size": total - live, "state": "inactive"}]
        out.append({"device": 0, "address": address, "total_size": total, "stream": 0, "segment_type": kind,
                    "segment_pool_id": (0, 0), "is_expandable": False, "blocks": blocks})
    return out


def run_stream(sim: CachingAllocatorSim, ops: list[list[Any]]) -> None:
    live: dict[int, int] = {}
    for op in ops:
        if op[0] == "malloc":
            live[op[1]] = sim.malloc(op[2])
        else:
            sim.free(live.pop(op[1]))


def section_truth(repeat: int) -> None:
    total_ops = 0
    total_time = 0.0
    for directory in TRUTH_DIRS:
        for path in sorted(directory.glob("*.json")):
            if path.name.endswith(".addresses.json"):
                continue
            doc = json.loads(path.read_text())
            ops = sum(len(c["ops"]) for c in doc["cases"].values())
            took = best_of(repeat, partial(replay_cases, doc))  # in file order, one driver-address model
            total_ops += ops
            total_time += took
            print(f"  {path.name:<100} {ops:>7} ops {ops / took:>10,.0f} ops/s")
    print(f"truth files: {total_ops:,} ops at {total_ops / total_time:,.0f} ops/s")


def section_stream(repeat: int) -> float:
    ops = synthetic_ops(200_000)
    for config in ("", "expandable_segments:True", "max_split_size_mb:256,roundup_power2_divisions:4"):
        took = best_of(repeat, partial(replay_ops, ops, config))
        print(f"stream [{config or 'defaults'}]: {len(ops):,} ops in {took:.3f} s = {len(ops) / took:,.0f} ops/s")
    took = best_of(repeat, lambda: run_stream(CachingAllocatorSim(), ops))
    rate = len(ops) / took
    print(f"stream, bare malloc/free on an empty allocator: {rate:,.0f} ops/s")
    return rate


def section_scale(repeat: int) -> None:
    ops = synthetic_ops(200_000)
    empty = len(ops) / best_of(repeat, lambda: run_stream(CachingAllocatorSim(), ops))
    print(f"scale: empty allocator: {empty:,.0f} ops/s")
    for segments in (1_000, 10_000, 100_000):
        state = read_allocator_state(synthetic_snapshot(segments))
        started = time.perf_counter()
        seeded_simulator(state)
        seeding = time.perf_counter() - started
        timings: list[float] = []
        for _ in range(repeat):
            sim = seeded_simulator(state)
            started = time.perf_counter()
            run_stream(sim, ops)
            timings.append(time.perf_counter() - started)
        rate = len(ops) / min(timings)
        print(f"scale: {segments:>7,} live segments ({len(state.segments):,} read, {seeding:.2f} s to seed): "
              f"{rate:,.0f} ops/s = {empty / rate:.2f}x the empty-allocator time per op")
    for n in (5_000, 10_000, 20_000, 40_000, 200_000):
        rng = random.Random(1)
        sizes = [rng.randint(1, 600) * MIB + rng.randint(0, MIB) for _ in range(n)]
        sim = CachingAllocatorSim()
        started = time.perf_counter()
        for size in sizes:
            sim.malloc(size)
        print(f"scale: {n:>7,} live mallocs ({sim.num_device_alloc:,} new segments): "
              f"{time.perf_counter() - started:.2f} s")


def section_replay(repeat: int) -> None:
    from telemetry.model.indexer.replay import ArmSpec, ReplayParams, replay

    params = ReplayParams()
    arms = [ArmSpec("stock"), ArmSpec("fixed")]
    took = best_of(repeat, lambda: replay(params, arms, "sim"))
    result = replay(params, arms, "sim")
    n = sum(a.summary.ops for a in result.arms.values())
    print(f"replay 98,304 tokens x 45 layers, stock + fixed on sim: {n:,} ops in {took:.3f} s "
          f"({n / took:,.0f} ops/s incl. stats and summary)")


def section_whatif(repeat: int) -> None:
    from telemetry.model.allocsim.recorder import RecordingSim
    from telemetry.model.allocsim.snapshot_file import parse_snapshot_bytes
    from telemetry.model.allocsim.trace import read_trace
    from telemetry.model.allocsim.whatif import plan_trace, replay_plan

    rec = RecordingSim("")
    rng = random.Random(1)
    live: list[int] = []
    while len(rec.entries) < 1_000_000:
        r = rng.random()
        if live and (len(live) > 200 or r < 0.48):
            rec.free(live.pop(rng.randrange(len(live))))
        elif r < 0.4801:
            rec.empty_cache()
        elif r < 0.481:
            rec.snapshot()
        else:
            live.append(rec.malloc(rng.choice([rng.randint(1, MIB), rng.randint(MIB, 10 * MIB),
                                               rng.randint(10 * MIB, 200 * MIB)])))
    data = pickle.dumps(rec.dump())
    events = len(rec.entries)
    started = time.perf_counter()
    doc = parse_snapshot_bytes(data)
    unpickled = time.perf_counter() - started
    started = time.perf_counter()
    trace = read_trace(doc)
    read = time.perf_counter() - started
    started = time.perf_counter()
    plan = plan_trace(trace, False)
    planned = time.perf_counter() - started
    print(f"whatif: {events:,} events ({len(data) / 1e6:.0f} MB pickle without stacks): unpickle {unpickled:.2f} s, "
          f"read {read:.2f} s, plan {planned:.2f} s")
    for config in ("", "expandable_segments:True", "max_split_size_mb:256"):
        took = best_of(repeat, partial(replay_plan, plan, config, record_calls=config == ""))
        print(f"whatif: replay under {config or 'the defaults'!r}: {took:.2f} s ({len(plan.ops) / took:,.0f} ops/s)")


def section_forecast(repeat: int) -> None:
    from telemetry.model.indexer.forecast import forecast
    from telemetry.model.indexer.shape import REFERENCE_SHAPE

    for segments in (556, 5_000):
        snapshot = synthetic_snapshot(segments)
        took_read = best_of(repeat, partial(read_allocator_state, snapshot))
        state = read_allocator_state(snapshot)
        for tokens in (100_000, 200_000):
            took = best_of(repeat, partial(forecast, state, REFERENCE_SHAPE, tokens))
            print(f"forecast: {segments:,} segments, {tokens:,} tokens, 45 layers: read {took_read * 1e3:.1f} ms + "
                  f"seed and simulate {took * 1e3:.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", action="append", choices=SECTIONS, default=None)
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    print(f"python {platform.python_version()} on {platform.machine()}, {platform.processor() or 'cpu'}")
    sections: dict[str, Callable[[int], object]] = {
        "truth": section_truth, "stream": section_stream, "scale": section_scale, "replay": section_replay,
        "whatif": section_whatif, "forecast": section_forecast}
    for name in args.only or SECTIONS:
        sections[name](args.repeat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
