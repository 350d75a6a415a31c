"""The guard's side of the queue: the core (telemetry/admission/queue.py) keeps the waiters and their order; here a
held request only waits to be woken, for its deadline, or for its client to leave.

It is woken, never polled: the limit trackers call `kick` when a hook answers or a hold is released
(`LimitTracker.subscribe`), and so do the replicas' health checks; `kick` runs one `pump` on the loop's next turn,
which asks the core which prompts to decide again (`Admission.wake`).
"""

from __future__ import annotations

import asyncio

from telemetry.admission.core import Admission, Prompt
from telemetry.admission.decisions import Hold
from telemetry.admission.queue import OUTCOMES, PASS_FRACTION
from telemetry.admission.waiting import HeldPrompts, now
from telemetry.catalogue import metrics as catalogue
from telemetry.guard.metrics import GuardMetrics


class Waiters:
    """The guard's held requests: each waits in the front doors' one `HeldPrompts`; the queue's metrics here."""

    def __init__(self, core: Admission, metrics: GuardMetrics) -> None:
        self.core = core
        self.metrics = metrics
        self.held = HeldPrompts(lambda: (core,))

    def kick(self) -> None:
        """The limit may have risen: pump once on the loop's next turn (many kicks, one pump)."""
        self.held.kick()

    async def wait(self, prompt: Prompt, hold: Hold, gone: asyncio.Future[None]) -> bool:
        """Wait until the core wakes `prompt` or its deadline passes (True: decide again), or its client leaves
        (False: it has left the queue)."""
        self.metrics.queue_depth = self.core.queued
        if await self.held.wait(prompt, hold.deadline, gone):
            return True
        self.ended("client_left", self.core.leave(prompt, now()))
        return False

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
