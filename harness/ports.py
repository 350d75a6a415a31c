"""Free loopback ports for the demo's servers and the tests'. The default ports (the daemon's, the hook's, the lab
server's) are in one table: telemetry/scrape/ports.py.

A free port here is one that can be bound now, outside the kernel's ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range), and not handed out before by this process. Asking the kernel for
port 0 instead gives a port inside that range, which it may give again to a second caller before either has
bound it, or to an outgoing connection as its local port in the seconds before the server that was meant to
have it starts (seen: the demo's fixed arm's rank exporter could not listen). Only where the range leaves no
room outside it does this fall back to the kernel's choice.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

from telemetry.errors import RunError

_LOWEST = 10000  # above the well-known ports and the most used registered ones
_LOCK = threading.Lock()
_GIVEN: set[int] = set()
_RANDOM = random.SystemRandom()  # not the `random` module's state, which a caller may have seeded
_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux's default where unreadable)."""
    try:
        low, high = (int(v) for v in _PORT_RANGE.read_text().split()[:2])
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def free_port_block(count: int, host: str = "127.0.0.1", attempts: int = 2000) -> int:
    """A base port such that base .. base+count-1 are all free (for MEMTEL_PORT + local rank)."""
    low, high = ephemeral_range()
    spans = [(first, last - count + 1) for first, last in ((_LOWEST, low - 1), (high + 1, 65535))
             if last - count + 1 >= first]
    with _LOCK:
        for _ in range(attempts):
            if spans:
                first, last = _RANDOM.choice(spans)
                base = _RANDOM.randint(first, last)
            else:
                base = _kernel_port(host)
                if base + count > 65536:
                    continue
            block = range(base, base + count)
            if any(port in _GIVEN for port in block) or not all(_bindable(host, port) for port in block):
                continue
            _GIVEN.update(block)
            return base
    raise RunError(f"no block of {count} free ports found on {host}")


def free_port(host: str = "127.0.0.1") -> int:
    return free_port_block(1, host)
