"""The guard's side of the queue: the core (telemetry/admission/queue.py) keeps the waiters and their order; here a
held request only waits to be woken, for its deadline, or for its client to leave.

It is woken, never polled: the limit trackers call `kick` when a hook answers or a hold is released
(`LimitTracker.subscribe`), and so do the replicas' health checks; `kick` runs one `pump` on the loop's next turn,
which asks the core which prompts to decide again (`Admission.wake`).
"""

from __future__ import annotations

import asyncio
import time

from telemetry.admission.core import Admission, Now, Prompt
from telemetry.admission.decisions import Hold
from telemetry.admission.queue import OUTCOMES, PASS_FRACTION
from telemetry.catalogue import metrics as catalogue
from telemetry.guard.metrics import GuardMetrics


def now() -> Now:
    return Now(time.monotonic(), time.time())


class Waiters:
    """One future per held prompt, set when the core wakes it."""

    def __init__(self, core: Admission, metrics: GuardMetrics) -> None:
        self.core = core
        self.metrics = metrics
        self._woken: dict[Prompt, asyncio.Future[None]] = {}
        self._scheduled = False

    def kick(self) -> None:
        """The limit may have risen: pump once on the loop's next turn (many kicks, one pump)."""
        if self.core.line.waiters and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.pump)

    def pump(self) -> None:
        self._scheduled = False
        for prompt in self.core.wake(now()):
            woken = self._woken.get(prompt)
            if woken is not None and not woken.done():
                woken.set_result(None)

    async def wait(self, prompt: Prompt, hold: Hold, gone: asyncio.Future[None]) -> bool:
        """Wait until the core wakes `prompt` or its deadline passes (True: decide again), or its client leaves
        (False: it has left the queue)."""
        woken = self._woken[prompt] = asyncio.get_running_loop().create_future()
        self.metrics.queue_depth = self.core.queued
        try:
            self.kick()  # it may fit already (a hold was released between its refusal and now)
            left = hold.deadline - time.monotonic()
            if left > 0:
                await asyncio.wait((woken, gone), timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if gone.done():
                waited = self.core.leave(prompt, now())
                self.ended("client_left", waited)
                return False
            return True
        finally:
            del self._woken[prompt]

    def ended(self, outcome: str | None, waited_s: float | None) -> None:
        """A prompt left the queue (`outcome`, OUTCOMES) after `waited_s`: counted, and its room is free for the
        next (a kick)."""
        self.metrics.queue_depth = self.core.queued
        if outcome is None:
            return
        self.metrics.count(catalogue.GUARD_QUEUE_OUTCOMES, outcome)
        if outcome != "queue_full" and waited_s is not None:
            self.metrics.observe(catalogue.GUARD_QUEUE_WAIT, waited_s)
        self.kick()


__all__ = ["OUTCOMES", "PASS_FRACTION", "Waiters", "now"]
