"""telemetry/scrape/ports.py: one table of default ports, which the servers listen on and the readers try."""

from __future__ import annotations

import argparse

from telemetry.scrape import DAEMON_PORT, DEFAULT_PORTS, HOOK_PORT, LAB_PORT, hook_ports
from telemetry.url import parse_url


def test_the_servers_take_their_defaults_from_the_table() -> None:
    from harness.labserver.cli import configure as lab_configure
    from telemetry.daemon.config import DEFAULT_LISTEN
    from telemetry.daemon.settings import DaemonConfig
    from telemetry.hook.config import DEFAULT_PORT

    assert DEFAULT_LISTEN.endswith(f":{DAEMON_PORT}") and DaemonConfig().listen_port == DAEMON_PORT
    assert DEFAULT_PORT == HOOK_PORT
    from harness.labserver.cli import DEFAULT_LISTEN as LAB_DEFAULT_LISTEN
    from harness.labserver.cli import listen_address

    parser = argparse.ArgumentParser()
    lab_configure(parser)
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    assert listen_address(serve.parse_args(["--arm", "stock"]))[1] == LAB_PORT
    assert LAB_DEFAULT_LISTEN.endswith(f":{LAB_PORT}")
    assert dict(DEFAULT_PORTS) == {"daemon": DAEMON_PORT, "hook": HOOK_PORT, "lab": LAB_PORT}


def test_the_ledger_reads_the_daemon_and_the_hooks_on_the_tables_ports() -> None:
    from telemetry.ledger.scrape import DEFAULT_DAEMON, default_hook_urls

    assert parse_url(DEFAULT_DAEMON).port == DAEMON_PORT
    assert [parse_url(u).port for u in default_hook_urls(["n1"])] == list(hook_ports())
    assert hook_ports()[0] == HOOK_PORT
