"""Another tenant of the lab node's memory: `memtel lab serve --capacity-gb X --tenant GIB@START_S+DURATION_S`, or
`POST /lab/tenant` with `{"gib": G, "seconds": S}` while it serves.

On a DGX Spark the GPU's memory is the host's: another process (a second engine starting, a job) takes headroom
from a serving engine and gives it back when it ends (users saw it fall from 29 to 2.5 GiB in 9 s). The lab node
emulates that process: its bytes come out of the node (NodeMemory.set_tenant), so the ranks' launches and the
hook's fit budget (the node's free bytes) see it as they would see the process. It takes what it asks for, or
what the ranks leave free if that is less (it cannot take what they hold). One tenant at a time: a new one
replaces the last, and `gib` 0 gives the memory back now.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from harness.labserver.node_memory import GIB, NodeMemory
from telemetry import limits
from telemetry.argtypes import bounded_float

log = logging.getLogger("memtel.lab.tenant")

TENANT_FORMAT = "GIB@START_S+DURATION_S"


@dataclass(frozen=True)
class TenantPlan:
    """`--tenant`: take `nbytes` `start_s` after the ranks are up, give them back `duration_s` later."""

    nbytes: int
    start_s: float
    duration_s: float


_gib = bounded_float(0, limits.MAX_CAPACITY_GIB, above_minimum=True)
_seconds = bounded_float(0, limits.MAX_TENANT_S)
_duration = bounded_float(0, limits.MAX_TENANT_S, above_minimum=True)


def parse_tenant(text: str) -> TenantPlan:
    """The argparse type of `--tenant`: `0.9@5+20` takes 0.9 GiB 5 s after the ranks are up, for 20 s."""
    gib, at, rest = text.partition("@")
    start, plus, duration = rest.rpartition("+")   # rpartition: a start of 1e+3 keeps its sign
    if not (at and plus):
        raise argparse.ArgumentTypeError(f"expected {TENANT_FORMAT} (0.9@5+20: 0.9 GiB taken 5 s after the ranks "
                                         f"are up, for 20 s), got {text[:40]!r}")
    parts = []
    for name, parse, value in (("GIB", _gib, gib), ("START_S", _seconds, start), ("DURATION_S", _duration, duration)):
        try:
            parts.append(parse(value))
        except argparse.ArgumentTypeError as error:
            raise argparse.ArgumentTypeError(f"{TENANT_FORMAT}: {name}: {error}") from None
    return TenantPlan(int(parts[0] * GIB), parts[1], parts[2])


class Tenant:
    """The node's other tenant, in the server process: holds memory now or later, gives it back on a timer.

    Each call supersedes what an earlier one scheduled (a generation number: a timer that already fired but
    waits for the lock does nothing)."""

    def __init__(self, node: NodeMemory) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._generation = 0
        self._timer: threading.Timer | None = None
        self._until: float | None = None   # monotonic time the tenant gives its memory back

    def hold(self, nbytes: int, seconds: float | None = None) -> int:
        """Hold `nbytes` now (0: none), for `seconds` (None: until the next call); returns the bytes held."""
        with self._lock:
            return self._hold(nbytes, seconds)

    def schedule(self, plan: TenantPlan) -> None:
        with self._lock:
            self._later(plan.start_s, plan.nbytes, plan.duration_s)

    def stop(self) -> None:
        with self._lock:
            self._later(None, 0, None)

    def describe(self) -> dict[str, Any]:
        left = None if self._until is None else max(self._until - time.monotonic(), 0.0)
        return {"tenant_bytes": self.node.tenant_bytes(), "tenant_leaves_in_s": left}

    def _hold(self, nbytes: int, seconds: float | None) -> int:
        before = self.node.tenant_bytes()
        held = self.node.set_tenant(nbytes)
        self._later(seconds if held else None, 0, None)
        self._until = None if seconds is None or not held else time.monotonic() + seconds
        if held:
            short = f" (asked {nbytes / GIB:.2f}; the ranks hold the rest)" if held < nbytes else ""
            log.info("lab node: another tenant holds %.2f GiB of the node's %.2f GiB%s%s; %.2f GiB left free",
                     held / GIB, self.node.capacity_bytes / GIB, short,
                     "" if seconds is None else f" for {seconds:g} s", self.node.free_bytes() / GIB)
        elif nbytes:
            log.info("lab node: another tenant asked for %.2f GiB and got none: the ranks hold the node's %.2f GiB",
                     nbytes / GIB, self.node.capacity_bytes / GIB)
        elif before:
            log.info("lab node: the other tenant gave back %.2f GiB; %.2f GiB free", before / GIB,
                     self.node.free_bytes() / GIB)
        return held

    def _later(self, delay: float | None, nbytes: int, seconds: float | None) -> None:
        """Cancel what was scheduled; with a delay, hold `nbytes` for `seconds` then (lock held)."""
        self._generation += 1
        self._until = None   # a leave that was scheduled is no longer
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if delay is None:
            return
        generation = self._generation

        def fire() -> None:
            with self._lock:
                if generation == self._generation:
                    self._hold(nbytes, seconds)

        self._timer = threading.Timer(delay, fire)
        self._timer.name = "memtel-lab-tenant"
        self._timer.daemon = True
        self._timer.start()


__all__ = ["TENANT_FORMAT", "Tenant", "TenantPlan", "parse_tenant"]
