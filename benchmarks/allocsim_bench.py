"""Throughput of the caching-allocator simulator and of `memtel replay --allocator sim`.

    .venv/bin/python benchmarks/allocsim_bench.py [--repeat 5]

Prints ops/s for every captured truth file (the ops as recorded, rows compared too), for a
synthetic 200,000-op random stream, and the wall time of the 98,304-token, 45-layer replay
(both arms). Target (issue 4): >= 200,000 simulated ops/s; the 98k replay well under a second.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

from harness.allocsim import CachingAllocatorSim
from harness.allocsim.ops import replay_cases, replay_ops
from harness.indexer.replay import ArmSpec, ReplayParams, replay

REPO = Path(__file__).resolve().parents[1]
TRUTH_DIRS = [REPO / "tests" / "fixtures" / "allocator-truth", REPO.parent / "shared" / "data" / "allocator-truth"]


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def synthetic_ops(n: int, seed: int = 7) -> list[list]:
    rng = random.Random(seed)
    ops, live, next_id = [], [], 0
    while len(ops) < n:
        if live and (len(live) > 50 or rng.random() < 0.5):
            ops.append(["free", live.pop(rng.randrange(len(live)))])
        else:
            size = rng.choice([rng.randint(1, 2**20), rng.randint(2**20, 2**24), rng.randint(2**24, 2**29)])
            ops.append(["malloc", next_id, size])
            live.append(next_id)
            next_id += 1
    return ops


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(f"python {platform.python_version()} on {platform.machine()}, {platform.processor() or 'cpu'}")
    total_ops = total_time = 0.0
    for directory in TRUTH_DIRS:
        for path in sorted(directory.glob("*.json")):
            if path.name.endswith(".addresses.json"):
                continue
            doc = json.loads(path.read_text())
            ops = sum(len(c["ops"]) for c in doc["cases"].values())
            took = best_of(args.repeat, lambda: replay_cases(doc))  # in file order, one driver-address model
            total_ops += ops
            total_time += took
            print(f"{path.name:<100} {ops:>7} ops {ops / took:>10,.0f} ops/s")
    print(f"{'all truth files':<100} {int(total_ops):>7} ops {total_ops / total_time:>10,.0f} ops/s")
    ops = synthetic_ops(200_000)
    for config in ("", "expandable_segments:True", "max_split_size_mb:256,roundup_power2_divisions:4"):
        took = best_of(args.repeat, lambda: replay_ops(ops, config))
        print(f"synthetic random stream [{config or 'defaults'}]: {len(ops):,} ops in {took:.3f} s = {len(ops) / took:,.0f} ops/s")

    def bare():  # the simulator alone, without the op-file validation and row building
        sim = CachingAllocatorSim()
        live = {}
        for op in ops:
            if op[0] == "malloc":
                live[op[1]] = sim.malloc(op[2])
            else:
                sim.free(live.pop(op[1]))

    took = best_of(args.repeat, bare)
    print(f"synthetic random stream, bare malloc/free: {len(ops) / took:,.0f} ops/s")
    params = ReplayParams()
    took = best_of(args.repeat, lambda: replay(params, [ArmSpec("stock"), ArmSpec("fixed")], "sim"))
    result = replay(params, [ArmSpec("stock"), ArmSpec("fixed")], "sim")
    n = sum(a["summary"]["ops"] for a in result["arms"].values())
    print(f"replay 98,304 tokens x 45 layers, stock + fixed on sim: {n:,} ops in {took:.3f} s ({n / took:,.0f} ops/s incl. stats and summary)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
