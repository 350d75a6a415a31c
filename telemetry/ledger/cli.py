"""`memtel ledger`: where the memory is, now, for one or more nodes: per node, then per process.

Exit status (and `memtel top --once`'s): 0 when every daemon and every hook asked for answered, 1 when one
could not be read (the report says which and why), 2 for a bad flag.
"""

from __future__ import annotations

import argparse
import json
import sys

from telemetry.ledger.flags import SECONDS, could_not_read, url_list
from telemetry.ledger.render import SORTS, render
from telemetry.ledger.scrape import DEFAULT_DAEMON, take_report
from telemetry.scrape import hook_ports

HOOK_PORTS = f"{hook_ports()[0]}-{hook_ports()[-1]}"   # the hooks' default ports on a node, as the help says it


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Where the memory is: per node, host memory split into GPU processes, page cache, other "
                          "host memory and what nothing explains; per process, weights, KV cache, CUDA-graph pools, "
                          "other live tensors, the allocator's cache, memory outside the allocator and host RSS "
                          "(docs/metrics.md, \"Where the memory is\").")
    parser.add_argument("--daemon", type=url_list, default=[DEFAULT_DAEMON], metavar="URL[,URL...]",
                        help=f"the nodes' memtel daemons (default {DEFAULT_DAEMON})")
    parser.add_argument("--hooks", type=url_list, default=None, metavar="URL[,URL...]",
                        help=f"the ranks' hook exporters (default: ports {HOOK_PORTS} on each daemon's host, those "
                             "that answer)")
    parser.add_argument("--sort", choices=sorted(SORTS), default="rank", help="order of the process rows")
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
