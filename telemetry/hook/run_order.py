"""A memtel run's private directory: which process booted first, and each hooked process's order.

`memtel run` makes one directory per run (mode 0700, under `$XDG_RUNTIME_DIR/memtel` or
`/tmp/memtel-<uid>`) and names it in MEMTEL_RUN_DIR. In it:
- `order`: how many of the run's processes have started their hook so far. A process takes the next
  number once, when its hook starts (its first hooked call or the unresolved check), under an exclusive
  `flock`, so two processes never get the same number. It is the process's rank where no other source
  names one (telemetry/hook/rank.py), and the exporter listens on MEMTEL_PORT + that number.
- `first`: created (O_EXCL) by the first Python process of the run to boot; that process also
  watches for "nothing hooked anywhere" (telemetry/run/boot.py).

Every file goes through telemetry/safefs.py (no symlink followed, private modes). memtel run execs the
program, so the program's own Python process removes the directory at its exit (`remove_at_exit`, from
telemetry/run/boot.py) when no child of it is left that could still use it; otherwise (a child still
running, a program that is not Python, a kill) it stays, and the next memtel run removes those whose
process is gone. Reading or taking fails soft: None, and the caller goes on.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from telemetry import hook_env
from telemetry.errors import ConfigError
from telemetry.safefs import create_private, ensure_private_dir, open_private, write_all

RUN_DIR_ENV = hook_env.RUN_DIR
ORDER_FILE = "order"
FIRST_FILE = "first"
_RUN_NAME = re.compile(r"^run-(\d+)-[0-9a-f]{8}$")
_MAX_COUNTER_BYTES = 32


def runtime_base(environ: Mapping[str, str] = os.environ) -> Path:
    """Where run directories live: `$XDG_RUNTIME_DIR/memtel` (a per-user tmpfs) if set, else `/tmp/memtel-<uid>`."""
    xdg = environ.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg) and os.path.isdir(xdg):
        return Path(xdg) / "memtel"
    return Path(tempfile.gettempdir()) / f"memtel-{os.geteuid()}"


def create_run_dir(base: Path, pid: int) -> Path:
    """A fresh private run directory for the program that will run as `pid`, with its counter at 0.

    UnsafePathError (a ConfigError) where `base` cannot be made private (another user owns it, ...).
    """
    ensure_private_dir(base, what="memtel run's runtime directory")
    remove_stale(base)
    directory = base / f"run-{pid}-{secrets.token_hex(4)}"
    try:
        os.mkdir(directory, 0o700)
        os.close(create_private(directory / ORDER_FILE))
    except OSError as exc:
        raise ConfigError(f"cannot create memtel run's directory {directory}: {exc.strerror}") from None
    return directory


def remove_stale(base: Path) -> list[Path]:
    """Remove the run directories in `base` whose program is gone; returns them."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    for entry in entries:
        match = _RUN_NAME.match(entry.name)
        if match is None or not entry.is_dir(follow_symlinks=False) or _alive(int(match.group(1))):
            continue
        with contextlib.suppress(OSError):
            shutil.rmtree(entry.path)
            removed.append(Path(entry.path))
    return removed


def owner_pid(directory: str | os.PathLike[str]) -> int | None:
    """The pid a run directory is named after (the program's: memtel run's own, kept by exec), or None."""
    match = _RUN_NAME.match(Path(directory).name)
    return int(match.group(1)) if match else None


def remove_at_exit(directory: str | os.PathLike[str]) -> bool:
    """At the exit of the run's program: remove its directory unless a child of this process still runs (it
    may still take a number from `order`); True if removed. Never raises."""
    try:
        import psutil

        if any(child.is_running() and child.status() != psutil.STATUS_ZOMBIE
               for child in psutil.Process().children(recursive=True)):
            return False
        path = Path(directory)
        if owner_pid(path) != os.getpid() or path.is_symlink() or not path.is_dir():
            return False
        shutil.rmtree(path)
        return True
    except Exception:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's process: alive
        return True
    return True


def _open_counter(directory: str | os.PathLike[str]) -> int | None:
    try:
        ensure_private_dir(directory, create=False, what="memtel run directory")
        return open_private(Path(directory) / ORDER_FILE, os.O_RDWR)
    except (OSError, ConfigError):
        return None


def _read_counter(fd: int) -> int:
    text = os.pread(fd, _MAX_COUNTER_BYTES, 0).decode("ascii").strip()
    value = int(text) if text else 0
    if value < 0:
        raise ValueError(f"negative counter {value}")
    return value


def take(directory: str | os.PathLike[str]) -> int | None:
    """The next number of the run's counter (0 for the first process), or None where it cannot be read."""
    fd = _open_counter(directory)
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        value = _read_counter(fd)
        data = str(value + 1).encode()
        os.lseek(fd, 0, os.SEEK_SET)
        write_all(fd, data)
        os.ftruncate(fd, len(data))
        return value
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)   # releases the lock


def peek(directory: str | os.PathLike[str]) -> int | None:
    """How many of the run's processes have started their hook, or None where it cannot be read."""
    fd = _open_counter(directory)
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        return _read_counter(fd)
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)


def claim_first(directory: str | os.PathLike[str]) -> bool:
    """True in exactly one process of the run: the first to call this."""
    try:
        ensure_private_dir(directory, create=False, what="memtel run directory")
        os.close(create_private(Path(directory) / FIRST_FILE))
    except (OSError, ConfigError):
        return False
    return True


__all__ = ["FIRST_FILE", "ORDER_FILE", "RUN_DIR_ENV", "claim_first", "create_run_dir", "owner_pid", "peek",
           "remove_at_exit", "remove_stale", "runtime_base", "take"]
