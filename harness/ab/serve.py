"""A fresh server per arm: start it in its own process group, wait until healthy, stop it for sure.

The server runs in a new session (its own process group) so a Ctrl-C at the terminal reaches only
the harness, which then stops the server; stopping sends SIGTERM to the whole group (vLLM's API
server, engine core and workers), waits `stop_grace_s`, then SIGKILLs what is left.

If the harness itself is SIGKILLed nothing in it can run, so every server gets a watchdog: a small
process (`python -m harness.ab.serve watch HARNESS_PID PGID GRACE`) in its own session that stops the
group when the harness disappears. `--resume` also stops groups a previous run left (`kill_stale`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness.ab.config import ServeSpec
from harness.processes import wait_healthy
from telemetry.errors import RunError


class ServeError(RunError):
    """The server did not come up: it exited, or was not healthy in time (the message has the log tail)."""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_group(pgid: int, grace_s: float, leader: subprocess.Popen | None = None) -> str:
    """SIGTERM the group, wait up to grace_s for it to empty, SIGKILL the rest. Returns how it ended."""
    if not _group_alive(pgid):
        if leader is not None:
            leader.poll()
        return "already-exited"
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return "already-exited"
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if leader is not None:
            leader.poll()  # reap the leader, or the group stays "alive" as a zombie
        if not _group_alive(pgid):
            return "sigterm"
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return "sigterm"
    for _ in range(50):
        if leader is not None:
            leader.poll()
        if not _group_alive(pgid):
            break
        time.sleep(0.1)
    return "sigkill"


class ServedProcess:
    def __init__(self, spec: ServeSpec, log_path: Path, extra_env: dict[str, str] | None = None) -> None:
        self.spec = spec
        self.log_path = Path(log_path)
        self.extra_env = dict(extra_env or {})
        self.process: subprocess.Popen | None = None
        self.watchdog: subprocess.Popen | None = None
        self.started_monotonic = 0.0
        self.stop_how: str | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def env(self) -> dict[str, str]:
        env = dict(os.environ) if self.spec.inherit_env else {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        env.update(self.extra_env)
        env.update(self.spec.env)
        return env

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            log.write(f"\n=== memtel: starting {' '.join(self.spec.command)} at {started}\n".encode())
            log.flush()
            try:
                self.process = subprocess.Popen(
                    list(self.spec.command), env=self.env(), cwd=self.spec.cwd, stdout=log,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                )
            except OSError as exc:
                raise ServeError(f"cannot start {self.spec.command[0]!r}: {exc}") from None
        self.started_monotonic = time.monotonic()
        self.watchdog = subprocess.Popen(
            [sys.executable, "-m", "harness.ab.serve", "watch", str(os.getpid()), str(self.process.pid),
             str(self.spec.stop_grace_s)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, cwd=str(Path(__file__).resolve().parents[2]),
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_healthy(self) -> float:
        """Seconds from start to a 200 from the health URL; ServeError if it exits or times out."""
        if self.process is None:
            raise ServeError("the server was not started")
        return wait_healthy(self.spec.health_url, self.process, timeout_s=self.spec.startup_timeout_s,
                            log_path=self.log_path, what="server", error=ServeError, started=self.started_monotonic)

    def stop(self) -> str:
        if self.process is None:
            return "not-started"
        how = stop_group(self.process.pid, self.spec.stop_grace_s, leader=self.process)
        self.process.wait()
        if self.watchdog is not None and self.watchdog.poll() is None:
            self.watchdog.kill()
            self.watchdog.wait()
        self.stop_how = how
        return how


def kill_stale(pgid: int, command: list[str], grace_s: float = 10.0) -> bool:
    """Stop a group a killed harness left behind, if its leader still runs the recorded command."""
    try:
        cmdline = Path(f"/proc/{pgid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    if [c.decode(errors="replace") for c in cmdline if c] != list(command):
        return False
    stop_group(pgid, grace_s)
    return True


def _watch(parent_pid: int, pgid: int, grace_s: float) -> int:
    """The watchdog: when the harness is gone, stop the server group it started."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        if not _group_alive(pgid):
            return 0
        if not _process_running(parent_pid):
            stop_group(pgid, grace_s)
            return 0
        time.sleep(0.5)


def _process_running(pid: int) -> bool:
    """False when pid is gone or a zombie (killed, not yet reaped by its parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "watch":
        sys.exit(_watch(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])))
    sys.exit("usage: python -m harness.ab.serve watch HARNESS_PID PGID GRACE_S")
