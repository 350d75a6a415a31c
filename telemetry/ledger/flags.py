"""The flags `memtel ledger` and `memtel top` share, and the exit status both give when a source did not answer."""

from __future__ import annotations

import argparse

from telemetry.argtypes import bounded_float
from telemetry.errors import ConfigError
from telemetry.ledger import scrape
from telemetry.ledger.render import SORTS
from telemetry.ledger.scrape import DEFAULT_DAEMON, LedgerReport
from telemetry.scrape.ports import HOOK_PORT_RANGE

SECONDS = bounded_float(0, 60, above_minimum=True)   # --timeout, top's --interval


def url_list(text: str) -> list[str]:
    """argparse's type for URL lists: the reason in the one error line (argparse hides a ValueError's text)."""
    try:
        return scrape.url_list(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_sources(parser: argparse.ArgumentParser) -> None:
    """--daemon, --hooks and --sort: where `ledger` and `top` read, and how they order the process rows."""
    parser.add_argument("--daemon", type=url_list, default=[DEFAULT_DAEMON], metavar="URL[,URL...]",
                        help=f"the nodes' memtel daemons (default {DEFAULT_DAEMON})")
    parser.add_argument("--hooks", type=url_list, default=None, metavar="URL[,URL...]",
                        help=f"the ranks' hook exporters (default: ports {HOOK_PORT_RANGE} on each daemon's host, "
                             "those that answer)")
    parser.add_argument("--sort", choices=sorted(SORTS), default="rank", help="order of the process rows")


def could_not_read(report: LedgerReport) -> bool:
    """A daemon or a hook that was asked for did not answer (exit 1 in `ledger` and `top --once`)."""
    return any(n.error is not None and n.daemon_url for n in report.nodes) or any(
        h.error is not None for n in report.nodes for h in n.hooks)


__all__ = ["SECONDS", "add_sources", "could_not_read", "url_list"]
