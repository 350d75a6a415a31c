"""The queue's state: prompts that do not fit now wait for room, in arrival order, instead of a 503 at once.

Pure: `Admission` (core.py) keeps a `WaitLine`; the front door only waits for its prompt to be woken. `wake(rooms,
at_rest, ceiling, now)` walks the waiters in arrival order against the room of each replica in the pool:

- a waiter whose tokens fit the most room left is woken to be decided again (and that room is spent on it);
- the first waiter that does not fit is the head. A later, smaller one may pass it only while the head has waited
  less than `pass_s` (a quarter of the queue's wait); from then on nothing behind it is woken, and a newcomer that
  would fit waits behind it too (`blocked`, where the queue has room: with it full, the newcomer goes on rather than
  get a 503 "queue full" for a prompt that fits now), so the holds drain and the head goes next. A long prompt neither
  blocks every short one behind it nor starves. A head that would not fit a replica even with nothing in prefill
  (over its rank's limit at rest) blocks nobody: draining the holds cannot make it fit, only memory freeing can.

A waiter whose count proves it over the deployment's at-best limit (`ceiling`, once known) is woken too, wherever it
stands: decided again, it gets the permanent 400 and leaves instead of waiting in vain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

PASS_FRACTION = 0.25  # of the queue's wait: how long later requests may pass a head that does not fit
OUTCOMES = ("admitted", "timed_out", "client_left", "queue_full", "refused")


@dataclass
class Waiting:
    """A prompt's place in the queue."""

    since: float  # monotonic
    deadline: float
    tokens: int  # what it needs (its count, or its lower bound by words; a byte bound proves nothing)
    proven: bool  # `tokens` can prove a misfit (a count or a lower bound)
    trying: bool = False  # woken, being decided again (the room it was woken for is kept for it)


class Queued(Protocol):
    """What the line keeps of a waiter (core.py's `Prompt`): its place, None while it is not in the line."""

    waiting: Waiting | None


P = TypeVar("P", bound=Queued)


class WaitLine(Generic[P]):
    """The waiters in arrival order (a prompt is `P`: anything with a `waiting` place)."""

    def __init__(self, queue_s: float, max_queued: int) -> None:
        self.queue_s = queue_s
        self.max_queued = max_queued
        self.pass_s = queue_s * PASS_FRACTION
        self.waiters: list[P] = []

    @property
    def enabled(self) -> bool:
        return self.queue_s > 0 and self.max_queued > 0

    @property
    def full(self) -> bool:
        return len(self.waiters) >= self.max_queued

    def blocked(self, at_rest: int, now: float) -> bool:
        """A waiter has waited `pass_s` without fitting: a newcomer that fits goes behind it, not past it."""
        return any(not w.trying and now - w.since >= self.pass_s and w.tokens <= at_rest
                   for p in self.waiters if (w := p.waiting) is not None)

    def join(self, prompt: P, tokens: int, proven: bool, now: float) -> Waiting:
        prompt.waiting = Waiting(now, now + self.queue_s, tokens, proven)
        self.waiters.append(prompt)
        return prompt.waiting

    def leave(self, prompt: P) -> float | None:
        """Out of the queue; the monotonic time it joined (None: it was not in it)."""
        waiting = prompt.waiting
        if waiting is None:
            return None
        prompt.waiting = None
        if prompt in self.waiters:
            self.waiters.remove(prompt)
        return waiting.since

    def wake(self, rooms: list[int], at_rest: int, ceiling: int | None, now: float) -> list[P]:
        """The waiters to decide again now (marked `trying`); see the module."""
        if not rooms:
            return []
        rooms = list(rooms)
        woken = []
        for prompt in self.waiters:
            waiter = prompt.waiting
            if waiter is None:
                continue
            if ceiling is not None and waiter.proven and waiter.tokens > ceiling and not waiter.trying:
                waiter.trying = True  # over what the deployment can ever take: decided again, it leaves with the 400
                woken.append(prompt)
                continue
            best = max(range(len(rooms)), key=rooms.__getitem__)
            if waiter.trying:  # being decided on the room it was woken for: keep that room for it
                rooms[best] -= waiter.tokens
                continue
            if waiter.tokens <= rooms[best]:
                rooms[best] -= waiter.tokens
                waiter.trying = True
                woken.append(prompt)
            elif now - waiter.since >= self.pass_s and waiter.tokens <= at_rest:
                break  # the head has waited its turn and fits once the holds drain: nothing behind it passes
        return woken


__all__ = ["OUTCOMES", "PASS_FRACTION", "Queued", "WaitLine", "Waiting"]
