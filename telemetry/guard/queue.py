"""The guard's queue: a prompt that does not fit now waits for the limit to rise instead of getting 503 at once.

A waiter holds what the proxy already has of its request (the body it read once, its size) and the tokens it
needs. It is woken, never polled: the limit trackers call `kick` when a hook answers or a hold is released
(`LimitTracker.subscribe`), and so do the replicas' health checks; `kick` runs one `pump` on the loop's next
turn. The pump walks the waiters in arrival order (FIFO) against the room of each replica in the pool:

- a waiter whose tokens fit the most room left is woken to be decided again (and that room is spent on it);
- the first waiter that does not fit is the head. A later, smaller one may pass it only while the head has
  waited less than `pass_s` (a quarter of --queue-s); from then on nothing behind it is woken, and a newcomer
  that would fit waits behind it too (`blocked`), so the holds drain and the head goes next. A long prompt
  neither blocks every short one behind it nor starves. A head that would not fit a replica even with nothing
  in prefill (over its rank's limit at rest) blocks nobody: draining the holds cannot make it fit, only memory
  freeing can, and the others would wait for that in vain.

A waiter whose count proves it over the deployment's at-best limit (`at_best()`, once that is known: at_best.py)
is woken too, wherever it stands: decided again, it gets the permanent 400 and leaves the queue (outcome
`refused`) instead of waiting in vain. A woken waiter runs the whole admission again (the limit may have moved
since); refused again as transient, it keeps its place and waits on. Each waiter waits at most `queue_s` in all,
and leaves at once when its client closes the connection (`Channel.gone`). Outcomes, depth and wait times go to
the guard's metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from telemetry.catalogue import metrics as catalogue
from telemetry.guard.metrics import GuardMetrics
from telemetry.guard.refusal import Refusal

T = TypeVar("T")
PASS_FRACTION = 0.25  # of --queue-s: how long later requests may pass a head that does not fit
OUTCOMES = ("admitted", "timed_out", "client_left", "queue_full", "refused")


class QueueFull(Exception):
    """More than --max-queued requests would wait."""


class ClientLeft(Exception):
    """The client closed its connection while its request waited."""


class _Waiter:
    __slots__ = ("proven", "since", "tokens", "trying", "wake")

    def __init__(self, tokens: int, loop: asyncio.AbstractEventLoop, proven: bool = False) -> None:
        self.tokens = tokens
        self.proven = proven  # `tokens` is a count or a lower bound (not a byte bound): it can prove a misfit
        self.since = time.monotonic()
        self.trying = False  # woken, being decided again
        self.wake: asyncio.Future[None] = loop.create_future()


class GuardQueue:
    """Waiters in arrival order; `room()` is, for each replica in the pool, the tokens it can take now and with
    nothing in prefill."""

    def __init__(self, queue_s: float, max_queued: int, metrics: GuardMetrics,
                 room: Callable[[], list[tuple[int, int]]], at_best: Callable[[], int | None] = lambda: None) -> None:
        """room: see the class; at_best: the deployment's at-best tokens where known (at_best.py), else None."""
        self.queue_s = queue_s
        self.max_queued = max_queued
        self.pass_s = queue_s * PASS_FRACTION
        self.metrics = metrics
        self.room = room
        self.at_best = at_best
        self._waiters: list[_Waiter] = []
        self._scheduled = False

    @property
    def enabled(self) -> bool:
        return self.queue_s > 0 and self.max_queued > 0

    @property
    def depth(self) -> int:
        return len(self._waiters)

    def blocked(self) -> bool:
        """A waiter has waited `pass_s` without fitting: a newcomer that fits goes behind it, not past it."""
        if not self._waiters:
            return False
        now, at_rest = time.monotonic(), max((rest for _now, rest in self.room()), default=0)
        return any(not w.trying and now - w.since >= self.pass_s and w.tokens <= at_rest for w in self._waiters)

    def kick(self) -> None:
        """The limit may have risen: pump once on the loop's next turn (many kicks, one pump)."""
        if self._waiters and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.pump)

    def pump(self) -> None:
        self._scheduled = False
        found = self.room()
        if not found:
            return
        rooms = [tokens for tokens, _rest in found]
        at_rest = max(rest for _tokens, rest in found)
        ceiling = self.at_best()
        now = time.monotonic()
        for waiter in self._waiters:
            if ceiling is not None and waiter.proven and waiter.tokens > ceiling and not waiter.trying:
                waiter.trying = True  # over what the deployment can ever take: decided again, it leaves with the 400
                if not waiter.wake.done():
                    waiter.wake.set_result(None)
                continue
            best = max(range(len(rooms)), key=rooms.__getitem__)
            if waiter.trying:  # being decided on the room it was woken for: keep that room for it
                rooms[best] -= waiter.tokens
                continue
            if waiter.tokens <= rooms[best]:
                rooms[best] -= waiter.tokens
                waiter.trying = True
                if not waiter.wake.done():
                    waiter.wake.set_result(None)
            elif now - waiter.since >= self.pass_s and waiter.tokens <= at_rest:
                return  # the head has waited its turn and fits once the holds drain: nothing behind it passes

    async def wait(self, refusal: Refusal, tokens: int, gone: asyncio.Future[None],
                   attempt: Callable[[], Awaitable[T]]) -> T:
        """Wait until `attempt()` succeeds (it raises a transient Refusal while the prompt does not fit), at most
        queue_s; raises the last transient Refusal at the deadline, QueueFull, or ClientLeft."""
        if len(self._waiters) >= self.max_queued:
            self.metrics.count(catalogue.GUARD_QUEUE_OUTCOMES, "queue_full")
            raise QueueFull
        loop = asyncio.get_running_loop()
        waiter = _Waiter(tokens, loop, proves(refusal))
        self._waiters.append(waiter)
        self.metrics.queue_depth = len(self._waiters)
        deadline = waiter.since + self.queue_s
        outcome = "timed_out"
        try:
            self.kick()  # it may fit already (a hold was released between its refusal and now)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise refusal
                done, _ = await asyncio.wait((waiter.wake, gone), timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if gone.done():
                    outcome = "client_left"
                    raise ClientLeft
                if not done:
                    raise refusal
                try:
                    result = await attempt()
                except Refusal as again:
                    if not transient(again):
                        outcome = "refused"
                        raise
                    refusal, waiter.tokens, waiter.proven = again, needed(again, waiter.tokens), proves(again)
                    waiter.trying, waiter.wake = False, loop.create_future()
                    self.kick()
                    continue
                outcome = "admitted"
                return result
        finally:
            self._waiters.remove(waiter)
            self.metrics.queue_depth = len(self._waiters)
            self.metrics.count(catalogue.GUARD_QUEUE_OUTCOMES, outcome)
            self.metrics.observe(catalogue.GUARD_QUEUE_WAIT, time.monotonic() - waiter.since)
            self.kick()  # the room it kept, or its place at the head, is free for the next

def transient(refusal: Refusal) -> bool:
    """A refusal waiting can cure: the prompt does not fit now (or no replica is in the pool now)."""
    return refusal.status == 503 and refusal.reason in ("would_not_fit", "in_prefill", "no_replica")


def proves(refusal: Refusal) -> bool:
    """Whether the refusal's count can prove a prompt over a limit (an exact count or a lower bound by words; a
    byte bound is an upper bound and proves nothing)."""
    return refusal.body.get("error", {}).get("prompt_tokens_counted_by") in ("token_ids", "tokenize", "words")


def needed(refusal: Refusal, default: int) -> int:
    """The tokens a refused prompt needs (its count, or its lower bound by words), from the refusal's body."""
    tokens = refusal.body.get("error", {}).get("prompt_tokens")
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else default


__all__ = ["OUTCOMES", "PASS_FRACTION", "ClientLeft", "GuardQueue", "QueueFull", "needed", "proves", "transient"]
