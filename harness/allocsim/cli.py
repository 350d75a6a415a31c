"""`memtel allocsim FILE`: replay an op file on the caching-allocator simulator.

Reads the allocator-truth format (`config` and `cases` with `ops`; `after` is ignored, or compared
with `--check`) and prints ``{"cases": {"<name>": {"after": [[reserved, allocated,
num_device_alloc, num_device_free], ...]}}}``: one row per op, in order. Bad input exits non-zero
with a message naming the case, the op index and the problem.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from harness.allocsim.ops import OpFileError, first_mismatch, load_op_file, replay_cases


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, metavar="FILE", help="op file (JSON, the allocator-truth format); '-' reads stdin")
    parser.add_argument("--config", default=None, help="override the file's PYTORCH_CUDA_ALLOC_CONF string")
    parser.add_argument("--capacity-gb", type=float, default=None, help="simulated device capacity in GiB (default: unlimited)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare with the file's 'after' rows instead of printing: exit 1 and name the first differing op",
    )


def run(args: argparse.Namespace) -> int:
    try:
        if str(args.file) == "-":
            try:
                data = json.load(sys.stdin)
            except json.JSONDecodeError as exc:
                raise OpFileError(f"stdin: not valid JSON: {exc}") from None
        else:
            data = load_op_file(args.file)
        if args.config is not None and isinstance(data, dict):
            data = dict(data, config=args.config)
        capacity = int(args.capacity_gb * 1024**3) if args.capacity_gb is not None else None
        if capacity is not None and capacity < 0:
            raise OpFileError(f"--capacity-gb must be >= 0, got {args.capacity_gb}")
        results = replay_cases(data, capacity_bytes=capacity, source=str(args.file))
    except OpFileError as exc:
        print(f"memtel allocsim: {exc}", file=sys.stderr)
        return 2
    if not args.check:
        try:
            json.dump({"cases": {name: {"after": rows} for name, rows in results.items()}}, sys.stdout, separators=(",", ":"))
            sys.stdout.write("\n")
            sys.stdout.flush()
        except BrokenPipeError:  # `memtel allocsim f.json | head`: the reader left, nothing is wrong
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keep the interpreter's final flush quiet
        return 0
    failed = 0
    for name, rows in results.items():
        expected = data["cases"][name].get("after")
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
