"""The same situation gives the same exit code and one line, whatever the command (docs/cli.md, "Exit codes").

In-process (tests/support/cli.py's call_main), so each case costs milliseconds: a bad flag and a bad
--log-level are 2 everywhere; an address in use is 1 with one line naming HOST:PORT and the system's reason
(never asyncio's address tuple) for every server command; a source that does not answer is 1.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from telemetry import cli
from telemetry.errors import EXIT_CODES, INTERRUPTED
from tests.support.cli import call_main, command_tree
from tests.support.ports import free_port

COMMANDS = sorted(cli.all_commands())
PAGES = [path for path, _ in command_tree() if path]  # every subcommand and sub-subcommand
WITH_ACTIONS = sorted({path[:-1] for path in PAGES if len(path) > 1})  # ab, alerts, flight, lab
ROOT = Path(__file__).resolve().parents[1]


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def test_the_table_in_docs_cli_md_is_the_one_in_telemetry_errors():
    text = (ROOT / "docs" / "cli.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", text, re.MULTILINE)
    assert {int(code): situation.strip() for code, situation in rows} == EXIT_CODES
    assert EXIT_CODES[INTERRUPTED] == "interrupted (Ctrl-C)" and INTERRUPTED == 128 + signal.SIGINT


@pytest.mark.parametrize("path", PAGES, ids=" ".join)
def test_an_unknown_flag_is_bad_input_2_in_one_line_naming_the_subcommand(path):
    """Every subcommand and sub-subcommand: the line names the one that ran (`memtel lab serve: error`; issue 40
    found `memtel lab: error` for lab serve's own errors)."""
    result = call_main([*path, "--no-such-flag"])
    assert result.returncode == 2, (path, result.stderr)
    assert one_line(result.stderr).startswith(f"memtel {' '.join(path)}: error: "), result.stderr


@pytest.mark.parametrize("path", WITH_ACTIONS, ids=" ".join)
def test_a_command_without_its_subcommand_is_2_in_one_line(path):
    result = call_main(list(path))
    assert result.returncode == 2 and one_line(result.stderr).startswith(f"memtel {' '.join(path)}: ")


def test_a_sub_subcommands_own_error_names_it():
    result = call_main(["lab", "serve", "--arm", "stock", "--allocator", "cuda", "--capacity-gb", "1"])
    assert result.returncode == 2
    assert one_line(result.stderr).startswith("memtel lab serve: error: --capacity-gb 1 emulates")


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


def _interrupted(argv: list[str], ready: str, tmp_path: Path, timeout_s: float,
                 signum: signal.Signals = signal.SIGINT) -> int:
    """`memtel ARGV` as a console script, `signum` (SIGINT) once its log says `ready`; its exit status."""
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "telemetry", *argv], stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, cwd=ROOT,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + timeout_s
        while ready not in log.read_text(errors="replace"):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-2000:]
            time.sleep(0.05)
        process.send_signal(signum)
        return process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_ctrl_c_exits_130_in_the_daemon(tmp_path):
    argv = ["daemon", "--listen", "127.0.0.1:0", "--disable-collector", "kmsg", "--disable-collector", "nvml",
            "--no-flight-recorder"]
    assert _interrupted(argv, "memtel daemon listening on", tmp_path, 30) == INTERRUPTED


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, INTERRUPTED), (signal.SIGTERM, 0)])
def test_ctrl_c_exits_130_in_the_guard_and_sigterm_0(tmp_path, signum, status):
    nowhere = f"http://127.0.0.1:{free_port()}"  # the guard starts without its upstream or hooks answering
    argv = ["guard", "--upstream", nowhere, "--hooks", nowhere, "--listen", "127.0.0.1:0"]
    assert _interrupted(argv, "memtel guard on http://", tmp_path, 30, signum) == status


@pytest.mark.slow  # a lab server with one rank starts: seconds on a busy 2-core machine
def test_ctrl_c_exits_130_in_lab_serve(tmp_path):
    argv = ["lab", "serve", "--arm", "stock", "--allocator", "sim", "--ranks", "1", "--no-hook",
            "--listen", f"127.0.0.1:{free_port()}"]
    assert _interrupted(argv, "memtel lab serving", tmp_path, 120) == INTERRUPTED
