"""What the hook's allocation history costs per hooked call on a GPU (issue 37: the hook within 1.2x the floor with
history recording on). A benchmark, not a test; needs CUDA; run on the H200 (BENCHMARKS.md).

    PYTHONPATH=. python3 benchmarks/hook_history_gpu.py [--rounds 30] [--calls 2000] [--json out.json]

With MEMTEL_HOOK_HISTORY=1 the hook adds nothing to its own call path: torch's allocator recorder
(`torch.cuda.memory._record_memory_history(enabled="all", context=None)`, no stacks) logs every allocation and
free, and /snapshot compacts that log when asked (telemetry/hook/forecast/history.py). So the cost per hooked call
is the recorder's per allocation and free, times the allocations a hooked call makes (an indexer launch: its
logits and two top-k outputs, 3), set against the floor (the nested allocator binding and a kept-fd
/proc/meminfo read, as benchmarks/hook_overhead.py defines it).

Interleaved rounds, the recorder turned on and off between them (a noisy neighbour hits both alike):
  alloc_free        torch.empty of a launch-like size and its free, recorder off
  alloc_free_rec    the same with the recorder on
  floor             binding + pread
Prints the medians, the recorder's cost per allocation and free, and (floor + 3 x that) / floor against 1.2.
Also the time /snapshot takes to compact a recorded log of --compact-ops allocations (the exporter's thread).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = (8192 * 2048 * 4, 8192 * 2048 * 8, 1 << 20, 64 << 20)   # logits- and top-k-like, rounded by the allocator


def per_call_us(fn: Any, calls: int, sync: Any) -> float:
    sync()
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter_ns() - start) / calls / 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--compact-ops", type=int, default=200_000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("hook_history_gpu: needs a CUDA GPU (torch.cuda.is_available() is False); run it on the device machine",
              file=sys.stderr)
        return 2
    from telemetry.hook.forecast.history import from_torch_trace, start_torch_recording

    torch.cuda.init()
    device = torch.cuda.current_device()
    binding = torch._C._cuda_memoryStats
    fd = os.open("/proc/meminfo", os.O_RDONLY | os.O_CLOEXEC)
    keep = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in SIZES]   # the segments stay cached
    del keep
    index = [0]

    def alloc_free() -> None:
        index[0] = (index[0] + 1) % len(SIZES)
        tensor = torch.empty(SIZES[index[0]], dtype=torch.uint8, device="cuda")
        del tensor

    def floor() -> None:
        binding(device)
        os.pread(fd, 16384, 0)

    sync = torch.cuda.synchronize
    values: dict[str, list[float]] = {"alloc_free": [], "alloc_free_rec": [], "floor": []}
    for _ in range(args.rounds):
        torch.cuda.memory._record_memory_history(enabled=None)
        values["alloc_free"].append(per_call_us(alloc_free, args.calls, sync))
        if not start_torch_recording(torch):
            print("hook_history_gpu: this torch cannot record its allocator's history", file=sys.stderr)
            return 2
        values["alloc_free_rec"].append(per_call_us(alloc_free, args.calls, sync))
        torch.cuda.memory._record_memory_history(enabled=None)
        values["floor"].append(per_call_us(floor, args.calls, sync))
    medians = {name: statistics.median(v) for name, v in values.items()}
    recorder_us = medians["alloc_free_rec"] - medians["alloc_free"]
    ratio = (medians["floor"] + 3 * recorder_us) / medians["floor"]
    start_torch_recording(torch)
    for _ in range(args.compact_ops // 2):
        alloc_free()
    started = time.perf_counter()
    traces = torch.cuda.memory._snapshot()["device_traces"][device]
    read_s = time.perf_counter() - started
    history = from_torch_trace(traces)
    compact_s = time.perf_counter() - started - read_s
    torch.cuda.memory._record_memory_history(enabled=None)
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name(device),
           "torch": torch.__version__, "rounds": args.rounds, "calls": args.calls, "median_us": medians,
           "recorder_us_per_alloc_free": recorder_us, "per_hooked_call_over_floor": ratio,
           "target_le_1_2": ratio <= 1.2,
           "snapshot_trace_entries": len(traces), "snapshot_read_s": read_s, "compact_s": compact_s,
           "compacted_ops": None if history.ops() is None else len(history.ops() or []), "lost": history.lost}
    print(json.dumps(out, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
