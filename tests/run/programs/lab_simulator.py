"""The lab indexer's logits launches (preset lab-indexer) on the caching-allocator simulator, in two spawned
workers: each grows the logits width per launch as a prefill does, frees the previous launch after the next
one, and writes the simulator's counters after each launch to <out>/expected-<pid>.json for the test to
compare with the hook's records. Usage: lab_simulator.py OUT_DIR."""

import json
import multiprocessing
import os
import sys
from pathlib import Path

WIDTHS = (8192, 16384, 24576, 32768, 49152)
ROWS = 256


def worker(out: str) -> None:
    from telemetry.hook import set_allocator_source
    from telemetry.model.allocsim.simulator import CachingAllocatorSim
    from telemetry.model.indexer import launch

    simulator = CachingAllocatorSim()
    set_allocator_source(simulator.stats)
    expected, previous = [], None
    for width in WIDTHS:
        current = launch.indexer_logits_launch(simulator, ROWS, width, width)
        expected.append(simulator.stats())
        if previous is not None:
            simulator.free(previous)
        previous = current
    Path(out, f"expected-{os.getpid()}.json").write_text(json.dumps(expected))


if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=worker, args=(sys.argv[1],)) for _ in range(2)]
    for process in workers:
        process.start()
    for process in workers:
        process.join()
    sys.exit(0 if all(p.exitcode == 0 for p in workers) else 1)
