"""`memtel whatif TRACE`: replay a recorded allocator history under other allocator settings.

TRACE is the pickle `torch.cuda.memory._dump_snapshot()` writes after
`torch.cuda.memory._record_memory_history()` (read without running any code in it), optionally
gzip-compressed. Prints one table (or `--json`): per setting the peak and final reserved bytes, the
cudaMallocs, and the counters at every `snapshot` event of the trace; says whether the replay under
the recorded settings reproduces the trace's own device calls exactly, and whether the trace is
complete. See telemetry/model/allocsim/whatif.py for the rules.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from telemetry.argtypes import bounded_float
from telemetry.command_helpers import GIB, add_snapshot_arguments, max_file_bytes, write_stdout
from telemetry.errors import ConfigError, RunError
from telemetry.limits import MAX_CAPACITY_GIB
from telemetry.model.allocsim.config import parse_alloc_conf


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", type=Path, metavar="TRACE",
                        help="a torch.cuda.memory._dump_snapshot() pickle recorded with _record_memory_history()")
    parser.add_argument("--config", action="append", default=[], metavar="CONF",
                        help="a PYTORCH_CUDA_ALLOC_CONF to replay the trace under (repeatable; '' for the defaults); "
                             "the recorded settings are always replayed")
    parser.add_argument("--capacity-gb", type=bounded_float(0, MAX_CAPACITY_GIB, above_minimum=True), default=None,
                        help="the device's memory in GiB: out-of-memory and a memory fraction as on that device "
                             "(default: unlimited; a fraction is taken of an H200's memory)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                        help="write reserved memory over the trace, one line per setting (needs matplotlib)")
    add_snapshot_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from telemetry.model.allocsim.trace import load_trace
    from telemetry.model.allocsim.whatif import format_table, whatif, write_plot

    for config in args.config:
        parse_alloc_conf(config)
    capacity = None
    if args.capacity_gb is not None:
        if not args.capacity_gb > 0:
            raise ConfigError(f"--capacity-gb must be > 0, got {args.capacity_gb}")
        capacity = int(args.capacity_gb * GIB)
    if args.plot is not None and args.plot.suffix.lower() != ".png":
        raise ConfigError(f"--plot writes a PNG: give a path ending in .png, got {args.plot}")
    trace = load_trace(args.trace, device=args.device, max_bytes=max_file_bytes(args), max_objects=args.max_objects,
                       max_blocks=args.max_blocks)
    result = whatif(trace, list(args.config), capacity_bytes=capacity, timeline=args.plot is not None)
    if args.plot is not None:
        try:
            write_plot(result, args.plot)
        except ImportError:
            raise ConfigError("--plot needs matplotlib (pip install matplotlib)") from None
        except OSError as exc:
            raise RunError(f"cannot write {args.plot}: {exc.strerror or exc}") from None
    if args.json:
        write_stdout(json.dumps(result.as_json(), indent=1))
    else:
        write_stdout(format_table(result, str(args.trace)) + (f"\n\nplot: {args.plot}" if args.plot else ""))
    return 0
