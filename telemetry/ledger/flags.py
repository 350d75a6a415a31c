"""The flags `memtel ledger` and `memtel top` share, and the exit status both give when a source did not answer."""

from __future__ import annotations

import argparse

from telemetry.argtypes import bounded_float
from telemetry.errors import ConfigError
from telemetry.ledger import scrape
from telemetry.ledger.scrape import LedgerReport

SECONDS = bounded_float(0, 60, above_minimum=True)   # --timeout, top's --interval


def url_list(text: str) -> list[str]:
    """argparse's type for URL lists: the reason in the one error line (argparse hides a ValueError's text)."""
    try:
        return scrape.url_list(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def could_not_read(report: LedgerReport) -> bool:
    """A daemon or a hook that was asked for did not answer (exit 1 in `ledger` and `top --once`)."""
    return any(n.error is not None and n.daemon_url for n in report.nodes) or any(
        h.error is not None for n in report.nodes for h in n.hooks)


__all__ = ["SECONDS", "could_not_read", "url_list"]
