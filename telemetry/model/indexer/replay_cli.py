"""`memtel replay`: the sparse indexer's logits allocations alone, on CUDA or on the simulator (the replay
itself is telemetry/model/indexer/replay.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from telemetry import limits
from telemetry.argtypes import bounded_float, bounded_int
from telemetry.command_helpers import write_stdout
from telemetry.errors import ConfigError, RunError
from telemetry.model.indexer.backends import ALLOCATORS, cuda_available
from telemetry.model.indexer.prefill import LaunchPattern
from telemetry.model.indexer.replay import (
    DEFAULT_TOKENS,
    ArmSpec,
    ReplayParams,
    format_table,
    replay,
    write_plot,
    write_records,
)
from telemetry.model.indexer.shape import MIB, add_shape_arguments, shape_from_args


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=bounded_int(1, limits.MAX_PREFILL_TOKENS), default=DEFAULT_TOKENS,
                        help=f"prefill length in tokens (default {DEFAULT_TOKENS}, at most "
                             f"{limits.MAX_PREFILL_TOKENS:,})")
    add_shape_arguments(parser, fixed_width=True, topk=True)
    parser.add_argument(
        "--arm", action="append", default=None, metavar="SPEC",
        help="MODE[+mempool][@ALLOC_CONF], repeatable; default: stock and fixed "
             "(e.g. 'stock@expandable_segments:True', 'fixed+mempool', 'stock@max_split_size_mb:256')")
    parser.add_argument("--mode", dest="arm", action="append", help=argparse.SUPPRESS)  # `memtel forecast`'s old name
    parser.add_argument("--alloc-conf", default="", help="PYTORCH_CUDA_ALLOC_CONF applied to every arm")
    parser.add_argument("--keep-previous", action=argparse.BooleanOptionalAction, default=True,
                        help="keep the previous launch's logits alive while the next allocates (default: yes)")
    parser.add_argument("--transient-mb", type=bounded_float(0, limits.MAX_TRANSIENT_MIB), default=0.0,
                        help="interleave a transient allocation of this many MiB per launch (rounded down to bytes)")
    parser.add_argument("--allocator", choices=ALLOCATORS, default=None,
                        help="default: cuda if available, else sim")
    parser.add_argument("--device", default="cuda", help="CUDA device for --allocator cuda (default cuda)")
    parser.add_argument("--capacity-gb", type=bounded_float(0, limits.MAX_CAPACITY_GIB), default=None,
                        help="simulated device capacity (sim only)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
    parser.add_argument("--out", type=Path, default=None, help="directory for replay.json and the PNG plot")
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                        help="PNG path, ending in .png (default OUT/replay-reserved.png when --out is given)")
    parser.add_argument("--record", type=Path, default=None,
                        help="write each arm's ops + counters in the truth format here")


def run(args: argparse.Namespace) -> int:
    from telemetry.model.allocsim.simulator import SimulatedOutOfMemoryError

    params = ReplayParams(shape_from_args(args), args.tokens,
                          LaunchPattern(keep_previous=args.keep_previous,
                                        transient_bytes=int(args.transient_mb * MIB)))
    if args.arm is not None and len(args.arm) > limits.MAX_REPLAY_ARMS:
        raise ConfigError(f"at most {limits.MAX_REPLAY_ARMS} --arm, got {len(args.arm)}")
    arms = [ArmSpec.parse(spec, args.alloc_conf) for spec in (args.arm or ["stock", "fixed"])]
    if args.plot is not None and (args.plot.suffix.lower() != ".png" or args.plot.is_dir()):
        raise ConfigError(f"--plot writes a PNG file: give a path ending in .png, got {args.plot}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out} is not a directory; expected a directory for replay.json and the plot")
    if args.record is not None and args.record.is_dir():
        raise ConfigError(f"--record {args.record} is a directory; expected a file path for the ops and counters")
    if args.allocator is None:
        allocator = "cuda" if cuda_available() else "sim"
        reason = ("default: CUDA is available" if allocator == "cuda"
                  else "default: no CUDA device here, using the simulator")
    else:
        allocator, reason = args.allocator, f"--allocator {args.allocator}"
        if allocator == "cuda" and not cuda_available():
            raise ConfigError("--allocator cuda needs torch with a CUDA device; use --allocator sim")
    capacity = int(args.capacity_gb * 1024**3) if args.capacity_gb else None
    try:
        result = replay(params, arms, allocator, device=args.device, capacity_bytes=capacity, reason=reason)
    except SimulatedOutOfMemoryError as exc:
        raise RunError(f"out of simulated memory (--capacity-gb {args.capacity_gb}): {exc}") from None
    except MemoryError:  # this machine's memory, not the simulated device's (its message is empty)
        raise RunError(f"this machine ran out of memory replaying {params.tokens:,} tokens over "
                       f"{params.shape.layers:,} layers; replay fewer") from None
    summary = result.to_json()
    plot_path = args.plot or (args.out / "replay-reserved.png" if args.out else None)
    try:
        if args.record:
            write_records(result, args.record)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "replay.json").write_text(json.dumps(summary, indent=1))
        if plot_path:
            write_plot(result, plot_path)
            summary["plot"] = str(plot_path)
    except OSError as exc:
        raise RunError(f"cannot write {exc.filename or 'the output'}: {exc.strerror or exc}") from None
    if args.json:
        write_stdout(json.dumps(summary, indent=1))
    else:
        write_stdout(format_table(result) + (f"\n\nplot: {plot_path}" if plot_path else ""))
    return 0
