"""One collection shared by every /metrics request it is fresh for.

A collection is fresh for a request when it began after the request's last byte was read: its values
are then at least as new as the request. Requests that arrive while a collection is under way wait for
it only if it began after them; otherwise they wait for it to end and start the next one, which every
request that arrived in the meantime shares. So a burst of N requests (pipelined on one connection, or
on N connections read in one turn of the selector) costs one or two collections, not N, and no request
is ever answered with values collected before it arrived.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class SharedCollection:
    """`body(arrived)`: the output of `render()` from a run that started at or after `arrived`.

    `arrived` is a `time.monotonic()` reading taken when the request was read. Runs never overlap; a
    run that raises is not shared (its caller sees the exception, a waiting request starts its own run).
    """

    def __init__(self, render: Callable[[], bytes]) -> None:
        self._render = render
        self._cond = threading.Condition()
        self._body: bytes | None = None
        self._started = float("-inf")  # when the run that made `_body` began
        self._running_since: float | None = None  # a run under way, and when it began
        self.runs = 0  # collections made (for tests and /healthz)

    def body(self, arrived: float) -> bytes:
        with self._cond:
            while True:
                if self._body is not None and self._started >= arrived:
                    return self._body
                if self._running_since is None:
                    break
                self._cond.wait()  # fresh or not, the run under way ends first; then share it or start the next
            started = time.monotonic()
            self._running_since = started
        body: bytes | None = None
        try:
            body = self._render()
            return body
        finally:
            with self._cond:
                self._running_since = None
                if body is not None:
                    self._body, self._started = body, started
                    self.runs += 1
                self._cond.notify_all()


__all__ = ["SharedCollection"]
