"""Child processes of the harness: dying with the parent, reading a log's tail, waiting for health.

One place for what the node daemon of the demo, the servers of `memtel ab` and the lab server's ranks
all need.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `signum` to this process when its parent dies (Linux; elsewhere nothing).

    Call it in the child: as `preexec_fn` of a `subprocess.Popen`, or first thing in a worker process.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def log_tail(path: Path, lines: int = 30) -> str:
    """The last `lines` lines of a log file, or "(no log)" when it cannot be read."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_healthy(url: str, process: subprocess.Popen, *, timeout_s: float, log_path: Path, what: str,
                 error: Callable[[str], Exception], started: float | None = None, interval_s: float = 0.2) -> float:
    """Seconds from `started` (default: now) until `url` answers 200.

    Raises `error(message)` when `process` exits first or `timeout_s` passes; the message says which and
    ends with the tail of `log_path`.
    """
    import httpx  # the harness extra: imported when a command runs, so every `--help` works without it

    start = time.monotonic() if started is None else started
    deadline = start + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            code = process.poll()
            if code is not None:
                raise error(f"{what} exited with code {code} before it was healthy; log {log_path}:\n"
                            f"{log_tail(log_path)}")
            try:
                if client.get(url).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(interval_s)
    raise error(f"{what} not healthy at {url} after {timeout_s:.0f} s; log {log_path}:\n{log_tail(log_path)}")


__all__ = ["die_with_parent", "log_tail", "wait_healthy"]
