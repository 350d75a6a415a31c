"""`memtel ledger`: where the memory is, now, for one or more nodes: per node, then per process."""

from __future__ import annotations

import argparse
import json
import sys

from telemetry.errors import ConfigError
from telemetry.ledger import scrape
from telemetry.ledger.render import SORTS, render
from telemetry.ledger.scrape import DEFAULT_DAEMON, take_report


def url_list(text: str) -> list[str]:
    """argparse's type for URL lists: the reason in the one error line (argparse hides a ValueError's text)."""
    try:
        return scrape.url_list(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 60:
        raise argparse.ArgumentTypeError(f"{text!r} is not a timeout: expected seconds from 0 to 60")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Where the memory is: per node, host memory split into GPU processes, page cache, other "
                          "host memory and what nothing explains; per process, weights, KV cache, CUDA-graph pools, "
                          "other live tensors, the allocator's cache, memory outside the allocator and host RSS "
                          "(docs/metrics.md, \"Where the memory is\").")
    parser.add_argument("--daemon", type=url_list, default=[DEFAULT_DAEMON], metavar="URL[,URL...]",
                        help=f"the nodes' memtel daemons (default {DEFAULT_DAEMON})")
    parser.add_argument("--hooks", type=url_list, default=None, metavar="URL[,URL...]",
                        help="the ranks' hook exporters (default: ports 9200-9207 on each daemon's host, those "
                             "that answer)")
    parser.add_argument("--sort", choices=sorted(SORTS), default="rank", help="order of the process rows")
    parser.add_argument("--timeout", type=positive_seconds, default=2.0, help="seconds per URL (default 2)")
    parser.add_argument("--json", action="store_true", help="one JSON object, for scripts")


def run(args: argparse.Namespace) -> int:
    report = take_report(args.daemon, args.hooks, timeout_s=args.timeout)
    if args.json:
        json.dump(report.as_dict(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print("\n".join(render(report, args.sort)))
    unreachable = any(n.error is not None and n.daemon_url for n in report.nodes) or any(
        h.error is not None for n in report.nodes for h in n.hooks)
    return 1 if unreachable else 0
