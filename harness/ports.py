"""Ports: the lab server's default, and free loopback ports for the demo's servers and the tests'.

The hook's exporter base port (MEMTEL_PORT, 9200) is the hook's own: `telemetry.hook.config.DEFAULT_PORT`;
the node daemon's (9101) is the daemon's. A port is free when it can be bound now.
"""

from __future__ import annotations

import socket

from telemetry.errors import RunError

LAB_SERVER_PORT = 8000  # vLLM's default: the harness talks to the lab server as to vLLM


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def free_port_block(count: int, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A base port such that base .. base+count-1 are all free (for MEMTEL_PORT + local rank)."""
    for _ in range(attempts):
        base = free_port(host)
        if base + count > 65535:
            continue
        socks = []
        try:
            for offset in range(count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind((host, base + offset))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RunError(f"no block of {count} free ports found on {host}")
