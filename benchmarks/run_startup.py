"""What `memtel run` adds to the start of each Python process it reaches: the bootstrap and the hook's install.

Starts `python -c pass` `--rounds` times in each of three environments, interleaved within each round:
plain (no bootstrap); the bootstrap with the hook installed (MEMTEL_TARGETS set, no exporter: nothing is
called, so none starts); the bootstrap with the hook off (no MEMTEL_TARGETS). Wall time per start, median,
p10/p90 and min over rounds, in milliseconds.

    python benchmarks/run_startup.py [--rounds N] [--python PATH] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from telemetry import hook_env

BOOTSTRAP = str(Path(__file__).resolve().parents[1] / "telemetry" / "run" / "bootstrap")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--json", help="write the numbers here too")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    base = {k: v for k, v in os.environ.items() if not k.startswith("MEMTEL_") and k != "PYTHONPATH"}
    cases = {
        "plain python -c pass": base,
        "bootstrap, hook installed": {**base, "PYTHONPATH": BOOTSTRAP, hook_env.TARGETS: "json:dumps",
                                      hook_env.PORT: "off"},
        "bootstrap, hook off": {**base, "PYTHONPATH": BOOTSTRAP},
    }
    for env in cases.values():   # warm the page cache
        subprocess.run([args.python, "-c", "pass"], env=env, check=True)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, env in cases.items():
            start = time.perf_counter()
            subprocess.run([args.python, "-c", "pass"], env=env, check=True)
            times[name].append((time.perf_counter() - start) * 1000)
    results = {}
    print(f"| start of `{args.python} -c pass` | median ms | p10 ms | p90 ms | min ms |")
    print("| --- | --- | --- | --- | --- |")
    for name, values in times.items():
        deciles = statistics.quantiles(values, n=10) if len(values) > 1 else values * 9
        results[name] = {"median_ms": statistics.median(values), "p10_ms": deciles[0], "p90_ms": deciles[-1],
                         "min_ms": min(values)}
        row = results[name]
        print(f"| {name} | {row['median_ms']:.1f} | {row['p10_ms']:.1f} | {row['p90_ms']:.1f} | {row['min_ms']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": args.rounds, "python": args.python, "results": results},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
