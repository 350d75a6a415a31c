"""Record real allocator histories under garbage collection, for `memtel whatif`'s exactness tests.

Run on a machine with a GPU (torch with CUDA):

    PYTHONPATH=. python3 -m telemetry.model.capture.gc_histories --out DIR [--set gc|empty-cache] [--dry-run]

Each run is one process with its own `PYTORCH_CUDA_ALLOC_CONF`: a `garbage_collection_threshold`
(which acts only under a memory fraction) and a `per_process_memory_fraction` (in the setting, or
through `torch.cuda.set_per_process_memory_fraction()` for the runs marked `api`), some with
`expandable_segments:True`. The workload is snapshots.run_workload (transformer layers over
requests of varying length, with indexer-style logits that grow with the position in the prompt)
in several shapes. The fraction is sized from that shape's peak reserved bytes under the defaults
(a probe run without recording), so that garbage collection has work to do.

Every run records its history with `torch.cuda.memory._record_memory_history()`, takes a
`_snapshot()` after every request (a `snapshot` event: the checkpoints) and writes:

- `gc-<name>.pickle.gz`: the `_snapshot()` document reduced to what a replay reads (per trace
  entry action, addr, size, stream and an OOM's device_free; per segment its fields and its blocks'
  address, size and state; `allocator_settings`), so the fixture stays small;
- `gc-<name>.json`: the run's own counters (reserved, allocated, num_device_alloc, num_device_free)
  at every checkpoint and at the end, the fraction and how it was set, the device's memory as
  `cudaMemGetInfo` and the device properties report it, torch's version, out-of-memory errors.

`--set gc` (the default) probes each shape's default peak and records RUNS; `--set empty-cache` records
RUNS_EMPTY_CACHE (an `empty_cache()` straight before an allocation that collects garbage) with the peaks
the first set measured. `--dry-run` runs the workers on the CPU (tiny workload, no recording): it checks
the script before GPU time is spent. tests/fixtures/allocator-gc-traces/README.md describes the files.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any

from telemetry.model.capture.snapshots import DRY_WORKLOAD, WORKLOAD, run_worker, run_workload

SHAPES: dict[str, dict[str, Any]] = {
    "a": WORKLOAD,
    "b": {"hidden": 1536, "heads": 12, "layers": 3, "chunk": 4096, "ratio": 2, "topk": 512,
          "seqs": [20000, 4000, 45000, 9000, 70000, 15000, 30000, 2000, 55000], "empty_cache_after": []},
    "c": {"hidden": 768, "heads": 6, "layers": 6, "chunk": 16384, "ratio": 4, "topk": 128,
          "seqs": [8000, 64000, 16000, 100000, 4000, 32000, 72000], "empty_cache_after": [3]},
}
# (shape, garbage_collection_threshold, fraction as a multiple of the shape's default peak, expandable, how,
#  requests after whose checkpoint empty_cache() runs, so that its cudaFrees lead straight into the next
#  request's first allocation and its new segment, with no `snapshot` event between)
Run = tuple[str, float, float, bool, str, tuple[int, ...]]
RUNS: tuple[Run, ...] = (
    ("a", 0.5, 1.2, False, "conf", ()),
    ("a", 0.3, 1.5, False, "api", ()),
    ("b", 0.5, 1.1, False, "conf", ()),
    ("b", 0.7, 2.0, False, "conf", ()),
    ("c", 0.6, 1.3, False, "conf", ()),
    ("c", 0.4, 1.2, False, "api", ()),
    ("a", 0.5, 1.2, True, "conf", ()),
    ("b", 0.6, 1.3, True, "conf", ()),
)
# The second device call: empty_cache() straight before an allocation that collects garbage. The shapes'
# default peaks come from the first call's probes (gc-probe-*.json), so this set runs no probe.
RUNS_EMPTY_CACHE: tuple[Run, ...] = (
    ("a", 0.5, 1.11, False, "conf", (2, 5)),  # the fraction is about 0.03, as in issue 19
    ("c", 0.5, 1.2, False, "api", (1, 4)),
    ("b", 0.5, 1.1, False, "conf", (2, 6)),
    ("b", 0.6, 1.3, True, "conf", (3, 6)),
)
PROBED_PEAKS = {"a": 4_051_697_664, "b": 7_201_619_968, "c": 7_361_003_520}  # H200, torch 2.11, first call
COUNTERS = ("reserved_bytes.all.current", "allocated_bytes.all.current", "num_device_alloc", "num_device_free")
TRACE_KEYS = ("action", "addr", "size", "stream", "device_free")
SEGMENT_KEYS = ("device", "address", "total_size", "stream", "segment_type", "segment_pool_id", "is_expandable")
BLOCK_KEYS = ("address", "size", "state")
H200_TOTAL_MEMORY = 150_109_880_320  # cudaMemGetInfo's total on the H200 (first call)


def run_name(shape: str, threshold: float, multiple: float, expandable: bool, how: str,
             empty_cache: tuple[int, ...] = ()) -> str:
    tail = "-ec" + ".".join(map(str, empty_cache)) if empty_cache else ""
    return f"{shape}-gc{threshold}-x{multiple}{'-es' if expandable else ''}-{how}{tail}"


def reduce_snapshot(doc: dict[str, Any]) -> dict[str, Any]:
    """What a replay reads of a `_snapshot()` document (no frames, no requested sizes)."""
    traces = [[{k: e[k] for k in TRACE_KEYS if k in e} for e in trace] for trace in doc.get("device_traces", [])]
    segments = []
    for s in doc.get("segments", []):
        segment = {k: s[k] for k in SEGMENT_KEYS if k in s}
        segment["blocks"] = [{k: b[k] for k in BLOCK_KEYS if k in b} for b in s.get("blocks", [])]
        segments.append(segment)
    return {"device_traces": traces, "segments": segments, "allocator_settings": doc.get("allocator_settings")}


def worker(out: Path, name: str, shape: str, fraction: float | None, how: str, record: bool, dry_run: bool,
           empty_cache: tuple[int, ...] = ()) -> None:
    import torch

    params = DRY_WORKLOAD if dry_run else SHAPES[shape]
    info: dict[str, Any] = {"name": name, "shape": shape, "params": params,
                            "config": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "fraction": fraction,
                            "fraction_set_by": how, "empty_cache_between": list(empty_cache),
                            "torch": torch.__version__}
    rows: list[list[int]] = []
    if dry_run:
        device = torch.device("cpu")

        def counters() -> list[int]:
            return [0, 0, 0, 0]
    else:
        torch.cuda.init()
        device = torch.device("cuda", torch.cuda.current_device())
        props = torch.cuda.get_device_properties(device)
        info.update(device=props.name, total_global_mem=int(props.total_memory),
                    mem_get_info_total=int(torch.cuda.mem_get_info(device)[1]))
        if fraction is not None and how == "api":
            torch.cuda.set_per_process_memory_fraction(fraction, device)

        def counters() -> list[int]:
            stats = torch.cuda.memory_stats(device)
            return [int(stats.get(k, 0)) for k in COUNTERS]

    recording = record and not dry_run
    if recording:
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=10_000_000)

    def checkpoint() -> None:
        if recording:
            torch.cuda.memory._snapshot()  # logs a `snapshot` event: the checkpoint in the history
        rows.append(counters())
        if len(rows) - 1 in empty_cache and not dry_run:
            torch.cuda.empty_cache()

    started = time.perf_counter()
    ooms = 0
    try:
        run_workload(torch, device, params, checkpoint)
    except torch.cuda.OutOfMemoryError as exc:  # recorded, the history is kept
        ooms += 1
        info["oom"] = str(exc).splitlines()[0][:300]
    rows.append(counters())
    info.update(checkpoints=rows, ooms=ooms, seconds=round(time.perf_counter() - started, 2))
    if not dry_run:
        info["peak_reserved"] = int(torch.cuda.memory_stats(device).get("reserved_bytes.all.peak", 0))
        info["allocator_settings"] = repr(torch.cuda.memory._snapshot().get("allocator_settings"))[:2000]
    if recording:
        doc = reduce_snapshot(torch.cuda.memory._snapshot())
        torch.cuda.memory._record_memory_history(enabled=None)
        with gzip.open(out / f"gc-{name}.pickle.gz", "wb", compresslevel=9) as f:
            pickle.dump(doc, f, protocol=4)
        info["events"] = sum(len(t) for t in doc["device_traces"])
    (out / f"gc-{name}.json").write_text(json.dumps(info, separators=(",", ":")))


def _run(out: Path, args: list[str], config: str, log: list[str]) -> bool:
    return run_worker("telemetry.model.capture.gc_histories", ["--out", str(out), *args], config, log)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--shape", default="a", help=argparse.SUPPRESS)
    parser.add_argument("--fraction", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--how", default="conf", help=argparse.SUPPRESS)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--empty-cache", default="", help=argparse.SUPPRESS)
    parser.add_argument("--set", choices=("gc", "empty-cache"), default="gc",
                        help="gc: probes and RUNS; empty-cache: RUNS_EMPTY_CACHE with the probed peaks")
    args = parser.parse_args(argv)
    out: Path = args.out
    dry = ["--dry-run"] if args.dry_run else []
    if args.worker:
        between = tuple(int(n) for n in args.empty_cache.split(",") if n)
        worker(out, args.worker, args.shape, args.fraction, args.how, not args.probe, args.dry_run, between)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    log: list[str] = []
    peaks: dict[str, int] = dict(PROBED_PEAKS) if args.set == "empty-cache" else {}
    for shape in SHAPES if args.set == "gc" else ():
        if _run(out, ["--worker", f"probe-{shape}", "--shape", shape, "--probe", *dry], "", log):
            doc = json.loads((out / f"gc-probe-{shape}.json").read_text())
            peaks[shape] = int(doc.get("peak_reserved", 0)) or 3 * 1024**3
    ok = len(peaks) == len(SHAPES)
    for shape, threshold, multiple, expandable, how, between in RUNS if args.set == "gc" else RUNS_EMPTY_CACHE:
        if shape not in peaks:
            continue
        probe = out / f"gc-probe-{shape}.json"
        total = int(json.loads(probe.read_text()).get("mem_get_info_total") or 0) if probe.exists() else 0
        fraction = math.ceil(multiple * peaks[shape] / (total or H200_TOTAL_MEMORY) * 10_000) / 10_000
        name = run_name(shape, threshold, multiple, expandable, how, between)
        config = f"garbage_collection_threshold:{threshold}"
        if expandable:
            config += ",expandable_segments:True"
        if how == "conf":
            config += f",per_process_memory_fraction:{fraction}"
        ok &= _run(out, ["--worker", name, "--shape", shape, "--fraction", str(fraction), "--how", how,
                         "--empty-cache", ",".join(map(str, between)), *dry], config, log)
    (out / f"gc-capture-{args.set}.log").write_text("\n".join(log) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
