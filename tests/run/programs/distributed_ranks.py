"""A torch.distributed program, one process per rank, started by torchrun (under memtel run in the tests).

Each rank joins the process group (NCCL with one GPU per rank, or gloo on the CPU), checks an all_reduce,
then makes prefill-like logits launches of growing width through the hooked function (the previous
launch's logits freed before the next, rank r's widths (r + 1) times rank 0's, so the devices differ),
reads its allocator's counters right after the last launch (torch.cuda.memory_stats of its own device:
nothing is allocated or freed in between) and waits to be scraped (handshake.py).
Usage: distributed_ranks.py HANDSHAKE_DIR cuda|cpu
"""

import os
import sys

import handshake
import memtel_run_target
import torch
import torch.distributed as dist

ROWS = 512
WIDTHS = (16384, 32768, 49152, 65536)   # float32 [512, N]: 32, 64, 96, 128 MiB on rank 0
COUNTERS = {"reserved_bytes": "reserved_bytes.all.current", "allocated_bytes": "allocated_bytes.all.current",
            "num_device_alloc": "num_device_alloc", "num_device_free": "num_device_free",
            "num_alloc_retries": "num_alloc_retries", "num_ooms": "num_ooms"}


def main() -> None:
    directory, kind = sys.argv[1], sys.argv[2]
    local_rank = int(os.environ["LOCAL_RANK"])
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    total = torch.ones(1, device=device)
    dist.all_reduce(total)
    assert int(total.item()) == dist.get_world_size()
    logits = None
    for width in WIDTHS:
        logits = None   # the previous launch's logits are freed before the next one
        logits = memtel_run_target.device_logits(ROWS, width * (local_rank + 1), device)
    counters = None
    if kind == "cuda":
        stats = torch.cuda.memory_stats(device)
        counters = {name: int(stats[key]) for name, key in COUNTERS.items()}
    handshake.report_and_wait(directory, len(WIDTHS), extra={
        "device": str(device), "local_rank": local_rank, "dist_rank": dist.get_rank(),
        "world_size": dist.get_world_size(), "counters": counters})
    del logits
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
