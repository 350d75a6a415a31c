"""`admit`: the admission core's decision for one prompt on one tracker, performed with callbacks, for the front
doors not yet moved onto `telemetry.admission.Admission` (the LiteLLM gate). The rules are the core's (core.py);
this only performs its CountFirst and ReadModels and turns its refusals into the raised `Refusal`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from telemetry.admission.at_best import AtBest
from telemetry.admission.core import Admission, Now, Prompt
from telemetry.admission.decisions import CountFirst, Forward, Hold, ReadModels
from telemetry.admission.pool import Replica
from telemetry.admission.prompt import PromptSize
from telemetry.guard.limit import LimitTracker
from telemetry.guard.refusal import ContextLength, Refusal


class _One(Admission):
    """One tracker, its deployment's at-best given by the caller."""

    def __init__(self, tracker: LimitTracker, at_best: Callable[[], tuple[AtBest | None, str | None]] | None) -> None:
        super().__init__([Replica("", tracker)])
        self._given = at_best

    def at_best(self, now: Now) -> tuple[AtBest | None, str | None]:
        return self._given() if self._given is not None else super().at_best(now)


async def admit(size: PromptSize, tracker: LimitTracker, context: ContextLength, *,
                tokenize: Callable[[], Awaitable[int]], fetch_models: Callable[[], Awaitable[tuple[int, bytes]]],
                blind: Callable[[], tuple[int, str]], rejected: Callable[[str], None],
                at_best: Callable[[], tuple[AtBest | None, str | None]] | None = None) -> tuple[int, str]:
    """(tokens held while the prefill runs, how they were counted); raises Refusal to refuse.

    tokenize: the upstream's count, the prompt's whole count (raises Refusal when it gives none); fetch_models: one
    GET of its /v1/models; blind: what to do with no limit (admit: (0, "blind"), or raise); rejected(reason): count
    a refusal; at_best: the deployment's at-best limit and why it is unknown (None: this tracker's alone).
    """
    if tracker.limit() is None:
        return blind()
    core = _One(tracker, at_best)
    replica = core.replicas[0]
    prompt = Prompt(size)
    while True:
        decision = core.decide(prompt, Now(time.monotonic(), time.time()))
        if isinstance(decision, Forward):
            if decision.counted_by == "blind":  # blind after a count (the hooks went stale meanwhile)
                core.release(decision, Now(time.monotonic(), time.time()))
                return blind()
            return decision.tokens, decision.counted_by
        if isinstance(decision, CountFirst):
            try:
                prompt.counted(await tokenize() - size.counted_tokens)
            except Refusal as refusal:
                prompt.not_counted(refusal)
        elif isinstance(decision, ReadModels):
            await context.get(fetch_models, size.model)
            replica.models.record(context.by_model, time.monotonic())
        elif isinstance(decision, Hold):  # no queue here: never held
            raise decision.refusal
        else:
            if decision.counted_as is not None:
                rejected(decision.counted_as)
            raise decision.refusal


__all__ = ["admit"]
