"""One daemon per state directory: an exclusive `flock` on `<state dir>/daemon.lock`, held until exit.

Two daemons on one state directory would write the same kernel-log state and the same flight ring. The
second one finds the lock taken and refuses with one line that names the first's pid (written into the
lock file by its holder). The kernel drops the lock when the holder exits, however it exits (a SIGKILL,
a crash), so a stale lock file never blocks the next start. The file is opened without following a
symlink (`safefs.open_private`), so a link planted in its place is refused, not written through.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

from telemetry.errors import ConfigError
from telemetry.safefs import open_private

LOCK_FILE_NAME = "daemon.lock"
_PID_WAIT_SECONDS = 0.5  # the holder writes its pid just after taking the lock
_held: dict[str, int] = {}  # state directory -> the lock file's descriptor, open until the process exits


class StateDirInUseError(ConfigError):
    """Another process holds the state directory's lock."""


def hold_state_dir(state_dir: str | os.PathLike[str]) -> None:
    """Take `state_dir`'s lock for the rest of this process (a no-op if this process holds it already).

    StateDirInUseError names the holder's pid; ConfigError if the lock file cannot be opened.
    """
    path = Path(state_dir) / LOCK_FILE_NAME
    key = os.path.realpath(state_dir)
    if key in _held:
        return
    try:
        fd = open_private(path, os.O_RDWR | os.O_CREAT)
    except OSError as exc:
        raise ConfigError(f"cannot open the state directory's lock file {path}: {exc.strerror or exc} "
                          "(expected a regular file, not a symbolic link)") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _holder(fd) if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise ConfigError(f"cannot lock {path}: {exc.strerror}") from None
        raise StateDirInUseError(
            f"another memtel daemon (pid {holder or 'unknown'}) is using the state directory {state_dir}; "
            "stop it first, or give this one another --state-dir DIR") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass  # the lock is what counts; a missing pid only makes the second daemon's line less precise
    _held[key] = fd


def _holder(fd: int) -> int | None:
    """The pid the lock's holder wrote, waiting briefly for a holder that has just taken it."""
    deadline = time.monotonic() + _PID_WAIT_SECONDS
    while True:
        try:
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        except OSError:
            return None
        if text.isdigit():
            return int(text)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


__all__ = ["LOCK_FILE_NAME", "StateDirInUseError", "hold_state_dir"]
