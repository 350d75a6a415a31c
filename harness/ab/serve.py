"""A fresh server per arm: start it in its own process group, wait until healthy, stop it for sure.

The server runs in a new session (its own process group) so a Ctrl-C at the terminal reaches only
the harness, which then stops the server; stopping sends SIGTERM to the whole group (vLLM's API
server, engine core and workers), waits `stop_grace_s`, then SIGKILLs what is left.

If the harness itself is SIGKILLed nothing in it can run, so every server gets a watchdog: a small
process (`python -m harness.ab.serve watch HARNESS_PID PGID GRACE`) in its own session that stops the
group when the harness disappears. `--resume` also stops groups a previous run left (`kill_stale`),
when the watchdog was killed too.

Which group is the run's is decided by identity, never by command line (a server started from a console
script, `vllm serve` or `memtel lab serve`, runs as `python .../bin/vllm serve ...`): the serve_start
record holds the leader's pid (= its process group and session: it was started in a new session), its
start time from /proc/<pid>/stat and the boot id. A process with that pid but another start time reused
the pid and is never touched; when the leader is gone, the group's remaining members (same process
group and session, started no earlier than the leader) are stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness.ab.config import ServeSpec
from harness.processes import wait_healthy
from telemetry.errors import RunError


class ServeError(RunError):
    """The server did not come up: it exited, or was not healthy in time (the message has the log tail)."""


PROC = Path("/proc")


@dataclass(frozen=True)
class ProcessInfo:
    """What /proc/<pid>/stat says about a process: its group, its session and when it started."""

    pid: int
    pgid: int
    session: int
    start_time_ticks: int  # clock ticks after boot
    state: str


def process_info(pid: int, proc: Path = PROC) -> ProcessInfo | None:
    """The process `pid` as /proc sees it now, or None when it does not exist (or cannot be read)."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    # The command name (field 2) is in parentheses and may contain spaces or ')'.
    fields = text.rpartition(")")[2].split()
    try:
        return ProcessInfo(pid=pid, state=fields[0], pgid=int(fields[2]), session=int(fields[3]),
                           start_time_ticks=int(fields[19]))
    except (IndexError, ValueError):
        return None


def boot_id(proc: Path = PROC) -> str | None:
    try:
        return (proc / "sys" / "kernel" / "random" / "boot_id").read_text().strip() or None
    except OSError:
        return None


def group_members(pgid: int, proc: Path = PROC) -> list[ProcessInfo]:
    """Every live process of process group `pgid` (zombies left out)."""
    members = []
    try:
        entries = [e.name for e in os.scandir(proc) if e.name.isdigit()]
    except OSError:
        return []
    for name in entries:
        info = process_info(int(name), proc)
        if info is not None and info.pgid == pgid and info.state != "Z":
            members.append(info)
    return members


def _group_alive(pgid: int) -> bool:
    """True while a process of the group runs. Zombies do not count: a member that outlived the leader (such as
    multiprocessing's resource tracker) is reaped by init, which may take seconds after it has exited."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool(group_members(pgid))


def stop_group(pgid: int, grace_s: float, leader: subprocess.Popen | None = None,
               verify: Callable[[], bool] | None = None) -> str:
    """SIGTERM the group, wait up to grace_s for it to empty, SIGKILL the rest. Returns how it ended.

    verify: checked right before each signal; False (the group is no longer the one meant) stops here.
    """
    if not _group_alive(pgid) or (verify is not None and not verify()):
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
    if verify is not None and not verify():
        return "sigterm"
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
    """One served command. `shown_command`: how the log's header names it (secrets redacted by the caller);
    `umask`: the command's (the harness itself runs with a private one while it writes a run)."""

    def __init__(self, spec: ServeSpec, log_path: Path, extra_env: dict[str, str] | None = None, *,
                 shown_command: list[str] | None = None, umask: int = -1) -> None:
        self.spec = spec
        self.log_path = Path(log_path)
        self.extra_env = dict(extra_env or {})
        self.shown_command = list(shown_command) if shown_command is not None else list(spec.command)
        self.umask = umask
        self.info: ProcessInfo | None = None  # the leader as /proc saw it right after the start
        self.boot_id: str | None = None
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
        from telemetry.safefs import open_private

        self.log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = open_private(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        except OSError as exc:
            raise ServeError(f"cannot open the server log {self.log_path}: {exc.strerror or exc}") from None
        with os.fdopen(fd, "ab") as log:
            started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            log.write(f"\n=== memtel: starting {' '.join(self.shown_command)} at {started}\n".encode())
            log.flush()
            try:
                self.process = subprocess.Popen(
                    list(self.spec.command), env=self.env(), cwd=self.spec.cwd, stdout=log,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, umask=self.umask,
                )
            except (OSError, ValueError) as exc:
                raise ServeError(f"cannot start {self.shown_command[0]!r}: {exc}") from None
        self.info = process_info(self.process.pid)
        self.boot_id = boot_id()
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


def stale_group(pid: int, start_time_ticks: int, recorded_boot_id: str | None,
                proc: Path = PROC) -> tuple[list[ProcessInfo], str]:
    """The live members of the server group a killed run left behind, and why (a sentence).

    The server was started in a new session, so its pid is its process group and session id. Its group
    is the run's when the leader still runs with the recorded start time; when the leader is gone, the
    members of its group and session that started no earlier than it did (the pid cannot have been
    reused while they hold it as their group id). A leader with another start time reused the pid:
    nothing is touched.
    """
    if recorded_boot_id is not None and boot_id(proc) not in (None, recorded_boot_id):
        return [], "the machine rebooted since"
    leader = process_info(pid, proc)
    if leader is not None and leader.state != "Z":
        if leader.start_time_ticks != start_time_ticks:
            return [], (f"pid {pid} now belongs to a process that started at tick {leader.start_time_ticks}, not "
                        f"{start_time_ticks}: the pid was reused, the process is left alone")
        if leader.pgid != pid:
            return [], f"pid {pid} left its process group; left alone"
    members = [m for m in group_members(pid, proc) if m.session == pid and m.start_time_ticks >= start_time_ticks]
    if not members:
        return [], "no process of its group is left"
    return members, f"{len(members)} process(es) of group {pid} still run"


def kill_stale(pid: int, pgid: int, start_time_ticks: int | None, recorded_boot_id: str | None,
               command: list[str] | None = None, grace_s: float = 10.0) -> str:
    """Stop a server group a killed harness left behind; returns what was done (for the console).

    Identity as in `stale_group`. Records written before start times were recorded (None) are matched
    by the leader's exact command line, as then.
    """
    if start_time_ticks is None:
        try:
            cmdline = (PROC / str(pgid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            return "gone"
        if command is None or [c.decode(errors="replace") for c in cmdline if c] != list(command):
            return "not matched (no start time recorded, and another command line)"
        return stop_group(pgid, grace_s)
    members, why = stale_group(pid, start_time_ticks, recorded_boot_id)
    if not members or pgid != pid:
        return f"not stopped: {why}"
    how = stop_group(pgid, grace_s, verify=lambda: bool(stale_group(pid, start_time_ticks, recorded_boot_id)[0]))
    return f"stopped ({how}): {why}"


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
