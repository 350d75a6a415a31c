"""What several commands share: the flags of the commands that read allocator snapshots and traces
(`memtel allocsim`, `whatif`, `forecast`, `tune`), and stdout that a reader who left early does not break.

A room of its own, below every command's module, so that no command is another's helper library.
"""

from __future__ import annotations

import argparse
import os
import sys

from telemetry.argtypes import bounded_float, bounded_int
from telemetry.errors import ConfigError
from telemetry.limits import MAX_SNAPSHOT_BLOCKS, MAX_SNAPSHOT_FILE_BYTES, MAX_SNAPSHOT_OBJECTS

MAX_FILE_GIB = 1024.0  # --max-file-gb: the file is read into memory

GIB = 1024**3


def add_snapshot_arguments(parser: argparse.ArgumentParser) -> None:
    """`--device`, `--max-file-gb`, `--max-objects` and `--max-blocks`: the commands that read snapshots and traces."""
    parser.add_argument("--device", type=bounded_int(0, 1023), default=None,
                        help="the CUDA device to take from a snapshot of several devices")
    parser.add_argument("--max-file-gb", type=bounded_float(0, MAX_FILE_GIB, above_minimum=True),
                        default=MAX_SNAPSHOT_FILE_BYTES / GIB,
                        help="refuse snapshot files larger than this many GiB, before reading "
                             f"(default {MAX_SNAPSHOT_FILE_BYTES // GIB})")
    parser.add_argument("--max-objects", type=bounded_int(1, 10**9), default=MAX_SNAPSHOT_OBJECTS, metavar="N",
                        help="refuse snapshot files that hold more objects than this (dicts, lists and tuples "
                             f"while reading, and trace entries) (default {MAX_SNAPSHOT_OBJECTS:,})")
    parser.add_argument("--max-blocks", type=bounded_int(1, 10**9), default=MAX_SNAPSHOT_BLOCKS, metavar="N",
                        help="refuse snapshots of more segments and blocks than this, shared ones counted each "
                             f"time (default {MAX_SNAPSHOT_BLOCKS:,})")


def max_file_bytes(args: argparse.Namespace) -> int:
    """`--max-file-gb` in bytes."""
    if not args.max_file_gb > 0:
        raise ConfigError(f"--max-file-gb must be > 0, got {args.max_file_gb}")
    return int(args.max_file_gb * GIB)


def write_stdout(text: str) -> None:
    """Print `text`; a reader that left early (`| head`) is not an error."""
    try:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keep the interpreter's final flush quiet


__all__ = ["GIB", "MAX_FILE_GIB", "add_snapshot_arguments", "max_file_bytes", "write_stdout"]
