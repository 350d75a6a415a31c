"""In-process cost of one collection of the daemon's /proc collectors (no HTTP, no rendering).

    .venv/bin/python benchmarks/daemon_collect_bench.py [--collections 2000]

Runs `DaemonCollectors.collect()` over meminfo, vmstat, pressure, buddyinfo and processes on this machine's
/proc and prints p50 and p90 in ms. To compare two trees, run it with PYTHONPATH set to each checkout.
This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from telemetry.daemon.collectors.buddyinfo import BuddyinfoCollector
from telemetry.daemon.collectors.meminfo import MeminfoCollector
from telemetry.daemon.collectors.pressure import PressureCollector
from telemetry.daemon.collectors.processes import ProcessCollector
from telemetry.daemon.collectors.vmstat import VmstatCollector
from telemetry.daemon.registry import DaemonCollectors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collections", type=int, default=2000)
    args = parser.parse_args()
    wrapper = DaemonCollectors({"meminfo": MeminfoCollector(), "vmstat": VmstatCollector(),
                                "pressure": PressureCollector(), "buddyinfo": BuddyinfoCollector(),
                                "processes": ProcessCollector()})
    for _ in range(50):
        list(wrapper.collect())
    times = []
    for _ in range(args.collections):
        started = time.perf_counter()
        list(wrapper.collect())
        times.append(time.perf_counter() - started)
    times.sort()
    print(json.dumps({"collections": len(times), "p50_ms": round(statistics.median(times) * 1e3, 3),
                      "p90_ms": round(times[int(len(times) * 0.9)] * 1e3, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
