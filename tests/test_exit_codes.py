"""The same situation gives the same exit code and one line, whatever the command (docs/cli.md, "Exit codes").

In-process (tests/support/cli.py's call_main), so each case costs milliseconds: a bad flag and a bad
--log-level are 2 everywhere; an address in use is 1 with one line naming HOST:PORT and the system's reason
(never asyncio's address tuple) for every server command; a source that does not answer is 1.
"""

from __future__ import annotations

import socket

import pytest

from telemetry import cli
from tests.support.cli import call_main
from tests.support.ports import free_port

COMMANDS = sorted(cli.all_commands())


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_flag_is_bad_input_2_in_one_line(command):
    result = call_main([command, "--no-such-flag"])
    assert result.returncode == 2, (command, result.stderr)
    assert one_line(result.stderr).startswith(f"memtel {command}")


@pytest.mark.parametrize("argv", [["daemon", "--check-config"], ["guard", "--listen", "127.0.0.1:1", "--upstream",
                                                                   "http://127.0.0.1:1", "--hooks", "http://127.0.0.1:1"],
                                  ["lab", "serve", "--arm", "stock"]], ids=lambda argv: argv[0])
def test_a_bad_log_level_is_2_and_either_case_is_accepted(argv):
    result = call_main([*argv, "--log-level", "loud"])
    assert result.returncode == 2
    assert "--log-level: expected one of debug, info, warning, error (either case), got 'loud'" in one_line(
        result.stderr)


@pytest.fixture
def taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("server", ["daemon", "guard", "guard-metrics", "lab"])
def test_an_address_in_use_is_1_in_one_line_for_every_server(server, taken_port):
    address = f"127.0.0.1:{taken_port}"
    hooks = ["--upstream", "http://127.0.0.1:1", "--hooks", "http://127.0.0.1:1"]
    argv = {"daemon": ["daemon", "--listen", address, "--disable-collector", "kmsg", "--disable-collector", "nvml"],
            "guard": ["guard", "--listen", address, *hooks, "--log-level", "ERROR"],
            "guard-metrics": ["guard", "--listen", f"127.0.0.1:{free_port()}", "--metrics-listen", address, *hooks],
            "lab": ["lab", "serve", "--arm", "stock", "--no-hook", "--port", str(taken_port)]}[server]
    result = call_main(argv)
    line = one_line(result.stderr)
    assert result.returncode == 1, line
    assert line.endswith(f"error: cannot listen on {address}: Address already in use (another program is using it: "
                         "stop it or choose another port)"), line


def test_a_source_that_does_not_answer_is_1():
    url = f"http://127.0.0.1:{free_port()}"
    assert call_main(["ledger", "--daemon", url]).returncode == 1
    assert call_main(["top", "--once", "--daemon", url]).returncode == 1
