"""The guard's bounds (docs/guard.md "Limits"): connections, timeouts, sizes, the queue."""

from __future__ import annotations

from dataclasses import dataclass

# The queue is on by default: a burst the engine serves one prefill at a time waits its turn instead of a 503
# (docs/guard.md "The queue"; the burst through the OpenAI SDK in tests/guard/test_openai_client_lab.py).
DEFAULT_QUEUE_S = 30.0


@dataclass(frozen=True)
class GuardLimits:
    max_connections: int = 256
    idle_timeout_s: float = 90.0  # a client connection without a request
    request_timeout_s: float = 60.0  # from a request's first byte to its body's last (a 64 MiB body on a slow link)
    read_timeout_s: float = 10.0  # inside a request, the longest wait for the client's next bytes
    send_timeout_s: float = 60.0  # the longest a client may take nothing of an answer before it is dropped
    max_head_bytes: int = 16384
    max_body_bytes: int = 64 << 20  # a 1M-token prompt is 4 to 8 MB of JSON
    connect_timeout_s: float = 10.0  # to the upstream
    max_idle_upstream: int = 32  # kept-alive upstream connections
    # Requests a client may pipeline back to back (each answered before the next is read) before its connection is
    # closed: a client that sends thousands and reads nothing would otherwise keep the guard answering it.
    max_pipelined: int = 100
    queue_s: float = DEFAULT_QUEUE_S  # the longest a prompt that does not fit now waits for room (0: 503 at once)
    max_queued: int = 32  # waiting at most (each holds its body once: at most max_body_bytes)


__all__ = ["DEFAULT_QUEUE_S", "GuardLimits"]
