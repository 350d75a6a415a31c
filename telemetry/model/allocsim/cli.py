"""`memtel allocsim FILE`: replay an op file on the caching-allocator simulator.

Reads the allocator-truth format (`config` and `cases` with `ops`; `after` is ignored, or compared
with `--check`) and prints ``{"cases": {"<name>": {"after": [[reserved, allocated,
num_device_alloc, num_device_free], ...]}}}``: one row per op, in order. Bad input exits 2 with a
message naming the case, the op index and the problem.

`--from-snapshot SNAP` starts every case from a live allocator's state instead of an empty one
(`torch.cuda.memory_snapshot()` saved as JSON, or a `torch.cuda.memory._dump_snapshot()` pickle,
read without running any code in it; telemetry/model/allocsim/snapshot.py): the rows are then relative to
the snapshot's reserved and allocated bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from telemetry.argtypes import bounded_float
from telemetry.command_helpers import GIB, add_snapshot_arguments, max_file_bytes, write_stdout
from telemetry.limits import MAX_CAPACITY_GIB, MAX_OP_FILE_BYTES
from telemetry.model.allocsim.ops import OpFileError, first_mismatch, load_op_file, parse_op_json, replay_cases


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, metavar="FILE",
                        help="op file (JSON, the allocator-truth format); '-' reads stdin")
    parser.add_argument("--config", default=None, help="override the file's PYTORCH_CUDA_ALLOC_CONF string")
    parser.add_argument("--capacity-gb", type=bounded_float(0, MAX_CAPACITY_GIB), default=None,
                        help="simulated device capacity in GiB (default: unlimited)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare with the file's 'after' rows instead of printing: exit 1 and name the first differing op",
    )
    parser.add_argument("--from-snapshot", type=Path, default=None, metavar="SNAP",
                        help="start every case from this allocator snapshot (memory_snapshot() JSON or a "
                             "_dump_snapshot() pickle); rows are relative to its counters")
    add_snapshot_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if str(args.file) == "-":
        raw = sys.stdin.buffer.read(MAX_OP_FILE_BYTES + 1)
        if len(raw) > MAX_OP_FILE_BYTES:
            raise OpFileError(f"stdin: more than {MAX_OP_FILE_BYTES:,} bytes; expected an op file (JSON)")
        data = parse_op_json(raw, "stdin")
    else:
        data = load_op_file(args.file)
    if args.config is not None and isinstance(data, dict):
        data = dict(data, config=args.config)
    capacity = int(args.capacity_gb * GIB) if args.capacity_gb is not None else None
    if capacity is not None and capacity < 0:
        raise OpFileError(f"--capacity-gb must be >= 0, got {args.capacity_gb}")
    start = None
    if args.from_snapshot is not None:
        from telemetry.model.allocsim.snapshot import load_allocator_state

        start = load_allocator_state(args.from_snapshot, device=args.device, max_bytes=max_file_bytes(args),
                                     max_objects=args.max_objects, max_blocks=args.max_blocks)
        config = data.get("config") or "" if isinstance(data, dict) else ""
        if start.alloc_conf is not None and start.alloc_conf != config:
            print(f"memtel allocsim: note: the snapshot's process ran with {start.alloc_conf!r}; "
                  f"replaying under {config!r}", file=sys.stderr)
        for note in start.notes:
            print(f"memtel allocsim: note: {note}", file=sys.stderr)
    results = replay_cases(data, capacity_bytes=capacity, source=str(args.file), start=start)
    if not args.check:
        cases = {name: {"after": rows} for name, rows in results.items()}
        write_stdout(json.dumps({"cases": cases}, separators=(",", ":")))
        return 0
    failed = 0
    for name, rows in results.items():
        expected = data["cases"][name].get("after")
        if expected is not None and not isinstance(expected, list):
            raise OpFileError(f"case {name!r}: 'after' must be a list of rows, got {type(expected).__name__}")
        if expected is None:
            print(f"{name}: no 'after' rows to compare with", file=sys.stderr)
            failed += 1
            continue
        mismatch = first_mismatch(expected, rows)
        if mismatch is None:
            print(f"{name}: {len(rows)} ops, all rows agree")
        else:
            index, want, got = mismatch
            op = data["cases"][name]["ops"][index] if index < len(data["cases"][name]["ops"]) else None
            print(f"{name}: differs at op {index} {op}: truth {want}, simulator {got}")
            failed += 1
    return 1 if failed else 0
