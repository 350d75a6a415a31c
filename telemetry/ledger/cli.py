"""`memtel ledger`: where the memory is, now, for one or more nodes: per node, then per process.

Exit status (and `memtel top --once`'s): 0 when every daemon and every hook asked for answered, 1 when one
could not be read (the report says which and why), 2 for a bad flag.
"""

from __future__ import annotations

import argparse
import json
import sys

from telemetry.ledger.flags import SECONDS, add_sources, could_not_read
from telemetry.ledger.render import render
from telemetry.ledger.scrape import take_report


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Where the memory is: per node, host memory split into GPU processes, page cache, other "
                          "host memory and what nothing explains; per process, weights, KV cache, CUDA-graph pools, "
                          "other live tensors, the allocator's cache, memory outside the allocator and host RSS "
                          "(docs/metrics.md, \"Where the memory is\").")
    add_sources(parser)
    parser.add_argument("--timeout", type=SECONDS, default=2.0,
                        help="seconds for the whole read, every URL at once, above 0, at most 60 (default 2)")
    parser.add_argument("--json", action="store_true", help="one JSON object, for scripts")


def run(args: argparse.Namespace) -> int:
    report = take_report(args.daemon, args.hooks, timeout_s=args.timeout)
    if args.json:
        json.dump(report.as_dict(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print("\n".join(render(report, args.sort)))
    return 1 if could_not_read(report) else 0
