"""A torch.multiprocessing pool (spawn) whose workers call the hooked function on CPU tensors: once when
they start (on an empty [0, 3] tensor, so that every worker calls it whatever tasks it gets; a barrier holds
both until both have started), then once per task ([i + 1, 3]).
Usage: torch_pool.py TASKS. Prints the results as JSON."""

import json
import sys

import memtel_run_target
import torch
import torch.multiprocessing


def start(barrier) -> None:
    memtel_run_target.scale(torch.zeros(0, 3))
    barrier.wait(timeout=120)


def task(index: int) -> float:
    return float(memtel_run_target.scale(torch.ones(index + 1, 3)).sum())


if __name__ == "__main__":
    tasks = int(sys.argv[1])
    context = torch.multiprocessing.get_context("spawn")
    with context.Pool(2, initializer=start, initargs=(context.Barrier(2),)) as pool:
        print(json.dumps(pool.map(task, range(tasks), chunksize=1)), flush=True)
