"""Admit or refuse one sized completion request against the limit in force (the proxy calls `admit`).

1. The byte bound fits (and no field only the engine can count): admitted, holding the bound, unless the
   bound is far above the words and would take a large share of the rank (`PromptSize.count_to_hold`):
   then the upstream's /tokenize counts it first, so it holds what its prefill needs.
2. Exact ids or the words prove it over the limit: refused at once (refusal.py says permanent or transient:
   over max-model-len or over the deployment's trusted at-best limit, at_best.py; a words count that may or may
   not reach either is counted by /tokenize first).
3. Otherwise /tokenize counts it (a request with a field only the engine can count always goes here);
   prompt_embeds over the limit by their bound cannot be counted by anyone and are refused.

A /tokenize that fails while the byte bound already fits (the count was only for the hold) admits by the
bound; otherwise its answer is relayed (the proxy's `tokenize` raises the Refusal).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, NoReturn

from telemetry.guard.at_best import deployment_at_best
from telemetry.guard.refusal import ContextLength, Refusal, refusal_for, uncountable, undecided

if TYPE_CHECKING:
    from telemetry.guard.at_best import AtBest
    from telemetry.guard.limit import Limit, LimitTracker
    from telemetry.guard.prompt import PromptSize


async def admit(size: PromptSize, tracker: LimitTracker, context: ContextLength, *,
                tokenize: Callable[[], Awaitable[int]], fetch_models: Callable[[], Awaitable[tuple[int, bytes]]],
                blind: Callable[[], tuple[int, str]], rejected: Callable[[str], None],
                at_best: Callable[[], tuple[AtBest | None, str | None]] | None = None) -> tuple[int, str]:
    """(tokens held while the prefill runs, how they were counted); raises Refusal to refuse.

    tokenize: the upstream's count (raises Refusal when it gives none); fetch_models: one GET of its
    /v1/models; blind: what to do with no limit (admit: (0, "blind"), or raise); rejected(reason): count a
    refusal; at_best: the deployment's at-best limit and why it is unknown (at_best.deployment_at_best over
    every replica; None: this tracker's replica alone).
    """
    limit = tracker.limit()
    if limit is None:
        return blind()

    async def refuse(tokens: int, counted_by: str, limit: Limit) -> NoReturn:
        max_model_len = await context.get(fetch_models, size.model)
        best, unknown = at_best() if at_best is not None else deployment_at_best([tracker])
        if undecided(size, tokens, counted_by, max_model_len, best):
            try:
                tokens, counted_by = await tokenize(), "tokenize"
            except Refusal:
                pass  # the words stand: a transient refusal, as without max-model-len
        refusal = refusal_for(tokens, counted_by, limit, max_model_len, size.param, best, unknown)
        rejected(refusal.reason or "would_not_fit")
        raise refusal

    if size.fits_by_bound(limit.tokens) and not size.count_to_hold(limit.rank_tokens):
        tracker.hold(size.most_tokens)
        return size.most_tokens, "token_ids" if size.exact else "byte_bound"
    if size.exact or size.least_tokens > limit.tokens:
        await refuse(size.most_tokens if size.exact else size.least_tokens, "token_ids" if size.exact else "words",
                     limit)
    if size.tokenize_body is None:
        refusal = uncountable(size, limit)
        rejected(refusal.reason or "bad_request")
        raise refusal
    by_bound = size.fits_by_bound(limit.tokens)
    try:
        tokens, counted_by = await tokenize(), "tokenize"
    except Refusal:
        if not by_bound:
            raise
        tokens, counted_by = size.most_tokens, "byte_bound"
    limit = tracker.limit()  # the hooks and the holds may have changed while the upstream counted
    if limit is None:
        return blind()
    if tokens > limit.tokens:
        await refuse(tokens, counted_by, limit)
    tracker.hold(tokens)
    return tokens, counted_by


__all__ = ["admit"]
