"""Issue 19, item 6: two daemons on one state directory.

Before: a second daemon on the same state directory started without a word and would write the same
kernel-log state and flight ring. Now it refuses with one line naming the first's pid, and starts nothing.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

from tests.daemon.helpers import ROOT, Daemon
from tests.support.ports import free_port


def _daemon_args(tmp_path) -> tuple[str, ...]:
    (tmp_path / "kern.log").touch()
    return "--kmsg", str(tmp_path / "kern.log"), "--disable-collector", "nvml"


def test_two_daemons_on_one_state_directory(tmp_path):
    state = tmp_path / "state"
    args = _daemon_args(tmp_path)
    with Daemon(state, *args) as first:
        port = free_port()
        second = subprocess.run([sys.executable, "-m", "telemetry", "daemon", "--listen", f"127.0.0.1:{port}",
                                 "--state-dir", str(state), *args], cwd=ROOT, capture_output=True, text=True,
                                timeout=30)
        assert second.returncode == 2, second.stderr
        lines = second.stderr.splitlines()
        assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
        assert f"pid {first.proc.pid}" in lines[0] and str(state) in lines[0], lines[0]
        with socket.socket() as probe:  # nothing was left listening
            assert probe.connect_ex(("127.0.0.1", port)) != 0
        assert first.scrape().value("memtel_collector_success", collector="meminfo") == 1  # the first goes on
        first.proc.send_signal(signal.SIGKILL)  # the kernel drops the lock however its holder ends
        first.proc.wait(10)
    with Daemon(state, *args) as third:
        assert third.scrape().value("memtel_collector_success", collector="meminfo") == 1
        assert (state / "daemon.lock").read_text().strip() == str(third.proc.pid)
