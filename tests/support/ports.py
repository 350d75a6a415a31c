"""Free loopback ports for tests that start real servers.

The product's helper (harness/ports.py) asks the kernel for a free port, and the kernel may answer with the
same port to two calls made before either is bound, or hand it to an outgoing connection as its local port
a moment later. Tests start several servers side by side (two ladders in threads, three vLLM launches at
once), so here a port is taken from below the kernel's ephemeral range (where neither happens), is never
handed out twice in one test process, and is free on `host` when handed out.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_LOCK = threading.Lock()
_GIVEN: set[int] = set()
_LOWEST = 10000  # above the well-known and most registered service ports
_RANDOM = random.SystemRandom()  # not the `random` module's state, which a test may seed


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port_block(count: int, host: str = "127.0.0.1", attempts: int = 2000) -> int:
    """A base port such that base .. base+count-1 are free now and were not handed out before in this process."""
    high = _ephemeral_low() - count
    if high <= _LOWEST:
        raise RuntimeError(f"no room for test ports below the ephemeral range (starts at {_ephemeral_low()})")
    with _LOCK:
        for _ in range(attempts):
            base = _RANDOM.randrange(_LOWEST, high)
            block = range(base, base + count)
            if any(p in _GIVEN for p in block) or not all(_bindable(host, p) for p in block):
                continue
            _GIVEN.update(block)
            return base
    raise RuntimeError(f"no block of {count} free ports found on {host} in {attempts} tries")


def free_port(host: str = "127.0.0.1") -> int:
    """One free port, never handed out before in this process."""
    return free_port_block(1, host)


__all__ = ["free_port", "free_port_block"]
