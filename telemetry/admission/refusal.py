"""The refusals of every front door, said the way OpenAI clients understand them: permanent (400) or transient (503).

- **Permanent**: no wait can help. 400 in OpenAI's error shape, `type` `invalid_request_error`, `code`
  `context_length_exceeded`, no `Retry-After`, and `x-should-retry: false` (the OpenAI SDKs read it before the
  status). Two causes, told apart by `reason` and `limit_at_best_from`:
  - the prompt has at least the engine's max-model-len tokens (the engine refuses a prompt that leaves no
    room for an output token too): `reason` `context_length_exceeded`. Max-model-len is read from the
    upstream's `/v1/models` (vLLM and the lab put `max_model_len` in each model card), once a minute at most
    and only when a prompt is over the limit. Where the guard does not know it, or the memory limit is above
    it, the engine's own 400 reaches the client;
  - the prompt has more tokens than the deployment could take at best, with only its resident memory and an
    empty cache (`memtel_forecast_max_prefill_tokens_at_best`, read only where it can be trusted: at_best.py):
    `reason` `exceeds_memory_at_best`. The `code` is OpenAI's `context_length_exceeded` all the same: it is what
    clients test to trim a prompt and try again, which is exactly the cure (a memtel-specific code would leave
    them treating it as an unknown error), and for this deployment the memory is the context limit. The
    message, `reason` and `limit_at_best_from: memory` say it is memory, with the rank and node that set it.
  A count by bytes (an upper bound) never proves a prompt permanent.
- **Transient**: the prompt is within both but over the limit in force now (the rank's longest fitting
  prefill, less what admitted prefills hold), or the at-best limit is unknown (a hook without the gauge, stale,
  only measured during the guard's own prefills): 503 with `Retry-After` and `x-should-retry: true`.

Every refusal's body names the prompt's tokens and how they were counted, the limit now and at best, the
rank and node that set it, and the forecast against the budget in words that cannot be read the wrong way
round (`forecast`): `forecast_bytes` is the reserved growth that stays after a prefill, below the budget
it does not mean "fits", because what must fit is the peak during the prefill.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from telemetry.catalogue.fields import GUARD_BAD_REQUEST, GUARD_WOULD_NOT_FIT

if TYPE_CHECKING:
    from telemetry.admission.at_best import AtBest
    from telemetry.admission.prompt import PromptSize
    from telemetry.admission.readings import Limit

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
EXCEEDS_MEMORY_AT_BEST = "exceeds_memory_at_best"  # the `reason` of a permanent refusal by memory
INVALID_REQUEST = "invalid_request_error"  # OpenAI's `type` for a request no retry can make succeed
RETRY_AFTER_S = {"would_not_fit": 10, "in_prefill": 1, "blind": 5, "no_replica": 5}
SHOULD_RETRY = "x-should-retry"
MODELS_PATH = "/v1/models"
MODELS_REFRESH_S = 60.0  # an engine restarted with another --max-model-len is seen within a minute
MAX_MODELS_BYTES = 1 << 20
# A refusal by words that may or may not reach max-model-len is counted by /tokenize to say which, up to this
# much prompt text: the lab's /tokenize took about half a second for 1.3 MB here (BENCHMARKS.md), so telling
# permanent from transient stays under a second; a longer prompt is answered by its words (transient).
DECIDE_BY_TOKENIZE_BYTES = 1 << 20


def error_body(kind: str, message: str, status: int | str, **fields: Any) -> dict[str, Any]:
    """OpenAI's error shape: `message`, `type`, `param`, `code`, then the guard's own fields."""
    param = fields.pop("param", None)
    return {"error": {"message": message, "type": kind, "param": param, "code": status, **fields}}


class Refusal(Exception):
    """An answer the guard gives instead of forwarding: status, OpenAI error body, and retry headers.

    retry_after: seconds for `Retry-After` (a transient refusal; also sends `x-should-retry: true`).
    should_retry: False for a permanent refusal (`x-should-retry: false`); None sends no retry header.
    """

    def __init__(self, status: int, body: dict[str, Any], retry_after: int | None = None, *,
                 should_retry: bool | None = None, reason: str | None = None) -> None:
        super().__init__(body["error"]["message"])
        self.status = status
        self.body = body
        self.retry_after = retry_after
        self.should_retry = True if retry_after is not None and should_retry is None else should_retry
        self.reason = reason
        self.counted_as: str | None = None  # the memtel_guard_rejected reason it is counted under when answered

    @property
    def headers(self) -> tuple[tuple[str, str], ...]:
        found: list[tuple[str, str]] = []
        if self.retry_after is not None:
            found.append(("Retry-After", str(self.retry_after)))
        if self.should_retry is not None:
            found.append((SHOULD_RETRY, "true" if self.should_retry else "false"))
        return tuple(found)


def parse_models(data: bytes) -> dict[str, int]:
    """`max_model_len` of each model card in a /v1/models answer (vLLM's, the lab's); {} if none says."""
    if len(data) > MAX_MODELS_BYTES:
        return {}
    try:
        cards = json.loads(data).get("data")
    except (ValueError, AttributeError, RecursionError):
        return {}
    found = {}
    for card in cards if isinstance(cards, list) else []:
        if not isinstance(card, dict):
            continue
        tokens = card.get("max_model_len")
        if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0:
            found[str(card.get("id", ""))] = tokens
    return found


def permanent_from(max_model_len: int | None, at_best: AtBest | None) -> int | None:
    """The fewest tokens no wait can make fit: max-model-len, or one more than the at-best limit; None: unknown."""
    found = [n for n in (max_model_len, None if at_best is None else at_best.tokens + 1) if n is not None]
    return min(found) if found else None


def undecided(size: PromptSize, tokens: int, counted_by: str, max_model_len: int | None,
              at_best: AtBest | None = None) -> bool:
    """Counted by words, the prompt may or may not reach max-model-len (or exceed the at-best limit): only the
    engine's count says whether the refusal is permanent (worth one /tokenize, so a client neither retries in
    vain nor gives up wrongly), for a prompt of up to DECIDE_BY_TOKENIZE_BYTES of text."""
    bound = permanent_from(max_model_len, at_best)
    return (counted_by == "words" and bound is not None and size.tokenize_body is not None
            and tokens < bound and (size.engine_only is not None or size.most_tokens >= bound)
            and sum(len(t) for t in size.texts) <= DECIDE_BY_TOKENIZE_BYTES)


def refusal_for(tokens: int, counted_by: str, limit: Limit, max_model_len: int | None, param: str,
                at_best: AtBest | None = None, at_best_unknown: str | None = None) -> Refusal:
    """The refusal of a prompt of `tokens` (a count or, by words, a lower bound) over `limit`; `at_best`: the
    deployment's at-best limit where it is trusted (at_best.py), else None and `at_best_unknown` says why."""
    fit = limit.fit
    at_least = {"words": "at least ", "byte_bound": "at most "}.get(counted_by, "")
    counted = f"{at_least}{tokens:,} tokens (counted by {counted_by})"
    # the at-best limit by memory, where it is below max-model-len (else max-model-len is the one at best)
    memory = at_best if at_best is not None and (max_model_len is None or at_best.tokens < max_model_len) else None
    common: dict[str, Any] = {
        "prompt_tokens": tokens, "prompt_tokens_counted_by": counted_by, "limit_tokens": limit.tokens,
        "limit_tokens_at_best": max_model_len if memory is None else memory.tokens,
        "limit_at_best_from": "memory" if memory is not None else "max_model_len" if max_model_len else None,
        "max_prefill_tokens": limit.rank_tokens, "in_prefill_tokens": limit.in_prefill_tokens,
        "node": fit.node, "rank": fit.rank, "hook": limit.hook,
    }
    if memory is not None:
        common.update(at_best_node=memory.node, at_best_rank=memory.rank, at_best_hook=memory.hook)
    if max_model_len is not None and tokens >= max_model_len and counted_by != "byte_bound":
        message = (f"memtel guard: This model's maximum context length is {max_model_len:,} tokens. However, your "
                   f"prompt contains {counted}, which "
                   f"{'exceeds this limit' if tokens > max_model_len else 'leaves no room for output'}; no retry can "
                   f"succeed: shorten the prompt (rank {fit.rank} on node {fit.node} can take {limit.tokens:,} tokens "
                   "now)")
        body = error_body(INVALID_REQUEST, message, CONTEXT_LENGTH_EXCEEDED, param=param,
                          reason=CONTEXT_LENGTH_EXCEEDED, retryable=False, max_model_len=max_model_len, **common)
        return Refusal(400, body, None, should_retry=False, reason=CONTEXT_LENGTH_EXCEEDED)
    if at_best is not None and tokens > at_best.tokens and counted_by != "byte_bound":
        message = (f"memtel guard: the prompt has {counted}, more than this deployment can ever take: at best "
                   f"{at_best.tokens:,} tokens, what rank {at_best.rank} on node {at_best.node} could take with only "
                   f"its resident memory and an empty cache (the best of the replicas; the engine's max-model-len "
                   f"is {'unknown' if max_model_len is None else f'{max_model_len:,}'}); no retry can succeed: "
                   f"shorten the prompt (it can take {limit.tokens:,} tokens now)")
        body = error_body(INVALID_REQUEST, message, CONTEXT_LENGTH_EXCEEDED, param=param,
                          reason=EXCEEDS_MEMORY_AT_BEST, retryable=False, max_model_len=max_model_len, **common)
        return Refusal(400, body, None, should_retry=False, reason=EXCEEDS_MEMORY_AT_BEST)
    reason = "would_not_fit" if tokens > limit.rank_tokens else "in_prefill"
    now = (f"rank {fit.rank} on node {fit.node} can take a prefill of at most {limit.rank_tokens:,} tokens now"
           if reason == "would_not_fit" else
           f"it fits rank {fit.rank} on node {fit.node} ({limit.rank_tokens:,} tokens) alone, but not beside the "
           f"{limit.in_prefill_tokens:,} tokens of admitted requests still in their prefill")
    if memory is not None:
        best = (f"at best {memory.tokens:,} tokens (what rank {memory.rank} on node {memory.node} could take with "
                "an empty cache)")
    else:
        unknown = f"the at-best memory limit is unknown: {at_best_unknown or 'not read'}" if at_best is None else \
            "the at-best memory limit is above it"
        best = (f"at best {max_model_len:,} tokens (the engine's max-model-len; {unknown})" if max_model_len else
                f"at best: unknown (the upstream's /v1/models names no max_model_len; {unknown})")
    forecast_line = forecast_words(tokens, limit)
    message = (f"memtel guard: the prompt has {counted} and does not fit now: {now}; {best}; {forecast_line}; "
               f"retry in {RETRY_AFTER_S[reason]} s or shorten the prompt")
    grown = fit.forecast_at(tokens)
    body = error_body(GUARD_WOULD_NOT_FIT, message, 503, reason=reason, retryable=True, **common,
                      fit_budget_bytes=_int_or_none(fit.budget_bytes),
                      forecast_tokens=tokens if grown else None,
                      forecast_bytes=_int_or_none(grown[0]) if grown else None,
                      forecast_from_tokens=list(grown[1]) if grown else None, forecast=forecast_line)
    return Refusal(503, body, RETRY_AFTER_S[reason], reason=reason)


def behind(tokens: int, counted_by: str, limit: Limit) -> Refusal:
    """The transient answer of a prompt that fits now but queued behind an earlier one that has waited its turn
    (the queue's order rule, docs/guard.md); sent only if it is still waiting at --queue-s."""
    fit = limit.fit
    message = (f"memtel guard: the prompt has {tokens:,} tokens (counted by {counted_by}) and fits rank {fit.rank} on "
               f"node {fit.node} now ({limit.tokens:,} tokens), but waits behind an earlier request that does not fit "
               "yet and has waited its turn; retry later")
    body = error_body(GUARD_WOULD_NOT_FIT, message, 503, reason="in_prefill", retryable=True, prompt_tokens=tokens,
                      prompt_tokens_counted_by=counted_by, limit_tokens=limit.tokens, node=fit.node, rank=fit.rank,
                      hook=limit.hook)
    refusal = Refusal(503, body, RETRY_AFTER_S["in_prefill"], reason="in_prefill")
    refusal.counted_as = "in_prefill"
    return refusal


def forecast_words(tokens: int, limit: Limit) -> str:
    """The forecast against the budget in words that say which way round it is."""
    fit = limit.fit
    if fit.budget_bytes is None:
        return (f"forecast: the longest prefill whose forecast peak fits is {limit.rank_tokens:,} tokens "
                "(the budget is not exported)")
    budget = f"the budget of {_gib(fit.budget_bytes)} this rank may still take"
    if tokens <= limit.rank_tokens:
        return (f"forecast: a prefill of {tokens:,} tokens alone peaks within {budget}; the prefills still running "
                f"hold {limit.in_prefill_tokens:,} of its {limit.rank_tokens:,} tokens")
    grown = fit.forecast_at(tokens)
    if grown is None:
        return (f"forecast: a prefill of more than {limit.rank_tokens:,} tokens peaks above {budget} (the hook "
                f"forecasts no length at or above {tokens:,})")
    growth, lengths = grown
    source = "" if lengths == (tokens,) else \
        f" (drawn between the hook's forecasts for {' and '.join(f'{n:,}' for n in lengths)} tokens)"
    if growth > fit.budget_bytes:
        return (f"forecast: a prefill of {tokens:,} tokens grows the reserved memory by {_gib(growth)}{source}, "
                f"which exceeds {budget}, and its peak is higher still")
    return (f"forecast: a prefill of {tokens:,} tokens leaves {_gib(growth)} more reserved after it{source}, below "
            f"{budget}, but its peak during the prefill exceeds it: the longest prefill whose forecast peak fits is "
            f"{limit.rank_tokens:,} tokens")


def uncountable(size: PromptSize, limit: Limit) -> Refusal:
    """A prompt whose only bound is over the limit and that nobody can count (prompt_embeds): refused, never
    guessed low."""
    message = (f"memtel guard: prompt_embeds cannot be counted by the guard or the engine's /tokenize; bounded by "
               f"their bytes the prompt may have up to {size.most_tokens:,} tokens, over the {limit.tokens:,} that "
               "fit now; send token ids or text through the guard")
    body = error_body(GUARD_BAD_REQUEST, message, 400, param="prompt_embeds", reason="uncountable",
                      retryable=False, prompt_tokens=size.most_tokens, prompt_tokens_counted_by="embedding_bytes",
                      limit_tokens=limit.tokens)
    return Refusal(400, body, None, should_retry=False, reason="bad_request")


def _gib(value: float) -> str:
    return f"{value / (1 << 30):,.2f} GiB"


def _int_or_none(value: float | None) -> int | None:
    return int(value) if value is not None and value == value and abs(value) != float("inf") else None


__all__ = ["CONTEXT_LENGTH_EXCEEDED", "EXCEEDS_MEMORY_AT_BEST", "INVALID_REQUEST", "MODELS_PATH", "RETRY_AFTER_S",
           "SHOULD_RETRY", "Refusal", "behind", "error_body", "forecast_words", "parse_models",
           "permanent_from", "refusal_for", "uncountable", "undecided"]
