"""Refusals said the way clients understand them (permanent 400, transient 503), and the admission rules."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import pytest

from telemetry.guard.admission import admit
from telemetry.guard.limit import Limit, LimitTracker, RankFit
from telemetry.guard.prompt import SPECIAL_TOKENS_PER_PROMPT, measure
from telemetry.guard.refusal import ContextLength, Refusal, forecast_words, parse_models, refusal_for
from telemetry.url import parse_url

GIB = 1 << 30


def _limit(rank_tokens=1000, in_prefill=0, budget=4e9, growth=()):
    fit = RankFit("1", "spark-2", rank_tokens, budget, time.time(), tuple(growth))
    return Limit(rank_tokens - in_prefill, rank_tokens, in_prefill, fit, "http://10.0.0.2:9200/metrics")


def test_a_prompt_over_max_model_len_is_a_permanent_400_that_clients_do_not_retry():
    refusal = refusal_for(3000, "words", _limit(), 2000, "prompt")
    error = refusal.body["error"]
    assert refusal.status == 400 and refusal.headers == (("x-should-retry", "false"),)  # no Retry-After
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "context_length_exceeded",
                                                               "prompt")
    assert (error["max_model_len"], error["prompt_tokens"], error["prompt_tokens_counted_by"]) == (2000, 3000, "words")
    assert error["retryable"] is False and (error["rank"], error["node"]) == ("1", "spark-2")
    assert "maximum context length is 2,000 tokens" in error["message"] and "at least 3,000" in error["message"]
    assert "\n" not in error["message"]
    # The engine refuses a prompt that leaves no room for output, so max-model-len itself is permanent too.
    assert refusal_for(2000, "tokenize", _limit(), 2000, "messages").status == 400


def test_a_prompt_within_max_model_len_over_the_limit_now_is_a_transient_503():
    refusal = refusal_for(1500, "tokenize", _limit(), 2000, "prompt")
    error = refusal.body["error"]
    assert refusal.status == 503 and refusal.headers == (("Retry-After", "10"), ("x-should-retry", "true"))
    assert (error["type"], error["reason"], error["retryable"]) == ("memtel_would_not_fit", "would_not_fit", True)
    assert (error["limit_tokens"], error["limit_tokens_at_best"], error["limit_at_best_from"]) == (1000, 2000,
                                                                                                   "max_model_len")
    assert "at most 1,000 tokens now" in error["message"] and "at best 2,000 tokens" in error["message"]
    busy = refusal_for(800, "tokenize", _limit(in_prefill=600), 2000, "prompt")
    assert busy.headers[0] == ("Retry-After", "1") and busy.body["error"]["reason"] == "in_prefill"
    unknown = refusal_for(10**6, "words", _limit(), None, "prompt")  # the upstream names no max_model_len
    assert unknown.status == 503 and unknown.body["error"]["limit_tokens_at_best"] is None


def test_a_byte_bound_never_proves_a_prompt_too_long():
    assert refusal_for(3000, "byte_bound", _limit(), 2000, "prompt").status == 503


def test_the_forecast_is_said_against_the_budget_the_right_way_round():
    # The refusal: forecast_bytes 1,482,686,464 below fit_budget_bytes 1,610,612,736 read as "it fits".
    limit = _limit(rank_tokens=401_244, budget=1_610_612_736, growth=[(1_048_576, 1_482_686_464)])
    words = forecast_words(1_048_576, limit)
    assert "leaves 1.38 GiB more reserved after it, below the budget of 1.50 GiB" in words
    assert "its peak during the prefill exceeds it" in words and "401,244" in words
    over = forecast_words(1_048_576, _limit(rank_tokens=401_244, budget=1.5 * GIB, growth=[(1_048_576, 258 * GIB)]))
    assert "grows the reserved memory by 258.00 GiB, which exceeds the budget of 1.50 GiB" in over
    none = forecast_words(5000, _limit(growth=[(4000, 1e9)]))
    assert "a prefill of more than 1,000 tokens peaks above the budget" in none
    body = refusal_for(1_048_576, "words", limit, None, "prompt").body["error"]
    assert body["forecast"] == words and body["forecast_bytes"] == 1_482_686_464


def test_max_model_len_is_read_from_the_model_cards():
    cards = {"object": "list", "data": [{"id": "base", "max_model_len": 204_800},
                                        {"id": "lora", "max_model_len": 204_800}, {"id": "other"}]}
    assert parse_models(json.dumps(cards).encode()) == {"base": 204_800, "lora": 204_800}
    for junk in (b"", b"[]", b'{"data": 5}', b'{"data": [{"id": "x", "max_model_len": true}]}', b"{" * 100_000):
        assert parse_models(junk) == {}


def test_max_model_len_is_read_once_a_minute_and_a_failed_read_leaves_it_unknown():
    calls = []

    async def fetch():
        calls.append(1)
        return 200, json.dumps({"data": [{"id": "a", "max_model_len": 100}, {"id": "b", "max_model_len": 50}]}).encode()

    async def broken():
        raise OSError("connection refused")

    async def run():
        context = ContextLength()
        # Two refusals at once share one read: neither answers before max-model-len is known.
        first = await asyncio.gather(context.get(fetch, "a"), context.get(fetch, "b"))
        found = [*first, await context.get(fetch, "b"), await context.get(fetch, None)]
        return found, await ContextLength().get(broken, "a")

    found, unknown = asyncio.run(run())
    assert found == [100, 50, 50, 50] and len(calls) == 1 and unknown is None


class _Upstream:
    """What the proxy gives `admit`: the upstream's count and its model cards, recorded."""

    def __init__(self, count=None, max_model_len=None):
        self.count, self.max_model_len, self.calls = count, max_model_len, []

    async def tokenize(self):
        self.calls.append("/tokenize")
        if self.count is None:
            raise Refusal(502, {"error": {"message": "the upstream could not count"}})
        return self.count

    async def models(self):
        self.calls.append("/v1/models")
        card = {"id": "m"} if self.max_model_len is None else {"id": "m", "max_model_len": self.max_model_len}
        return 200, json.dumps({"data": [card]}).encode()


def _admit(body, upstream, rank_tokens=1000, path="/v1/completions"):
    tracker = LimitTracker([parse_url("http://127.0.0.1:9/metrics")], stale_s=60)
    tracker.record(tracker.hooks[0], [RankFit("0", "node-a", rank_tokens, 4e9, time.time())], None)
    rejected = []

    async def run():
        return await admit(measure(path, body), tracker, ContextLength(), tokenize=upstream.tokenize,
                           fetch_models=upstream.models, blind=lambda: (0, "blind"), rejected=rejected.append)
    try:
        return asyncio.run(run()), tracker.in_prefill_tokens, rejected
    except Refusal as refusal:
        return refusal, tracker.in_prefill_tokens, rejected


def test_one_word_and_many_spaces_holds_its_count_not_its_bytes():
    upstream = _Upstream(count=1)
    answer, held, _ = _admit({"prompt": "word" + " " * 399_999}, upstream, rank_tokens=401_244)
    assert answer == (1, "tokenize") and held == 1 and upstream.calls == ["/tokenize"]


def test_a_failed_count_for_the_hold_admits_by_the_byte_bound():
    answer, held, _ = _admit({"prompt": "word" + " " * 399_999}, _Upstream(count=None), rank_tokens=401_244)
    assert answer == (400_003 + SPECIAL_TOKENS_PER_PROMPT, "byte_bound") and held == answer[0]


def test_words_over_max_model_len_are_refused_permanently_without_tokenize():
    upstream = _Upstream(count=10**9, max_model_len=2000)
    refusal, held, rejected = _admit({"prompt": "w " * 3000}, upstream)
    assert isinstance(refusal, Refusal) and refusal.status == 400 and held == 0
    assert upstream.calls == ["/v1/models"] and rejected == ["context_length_exceeded"]


def test_words_below_max_model_len_with_more_bytes_are_counted_to_tell_permanent_from_transient():
    upstream = _Upstream(count=2500, max_model_len=2000)
    refusal, _, _ = _admit({"prompt": "w " * 1500}, upstream)  # 1,500 words, 3,002 bytes: maybe over 2,000
    assert refusal.status == 400 and refusal.body["error"]["prompt_tokens_counted_by"] == "tokenize"
    assert upstream.calls == ["/v1/models", "/tokenize"]
    upstream = _Upstream(count=1600, max_model_len=2000)
    refusal, _, rejected = _admit({"prompt": "w " * 1500}, upstream)
    assert refusal.status == 503 and rejected == ["would_not_fit"]


def test_a_field_only_the_engine_can_count_is_counted_even_when_the_bytes_fit():
    upstream = _Upstream(count=7)
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    answer, held, _ = _admit(body, upstream, rank_tokens=100_000, path="/v1/chat/completions")
    assert answer == (7, "tokenize") and held == 7 and upstream.calls == ["/tokenize"]


def test_prompt_embeds_are_admitted_by_their_byte_bound_or_refused_never_guessed():
    small = base64.b64encode(b"\0" * 500).decode()
    answer, _, _ = _admit({"prompt_embeds": small}, _Upstream())
    assert answer == (500, "byte_bound")
    big = base64.b64encode(b"\0" * 5000).decode()
    refusal, held, rejected = _admit({"prompt_embeds": big}, _Upstream())
    assert refusal.status == 400 and refusal.body["error"]["param"] == "prompt_embeds" and held == 0
    assert "cannot be counted" in refusal.body["error"]["message"] and rejected == ["bad_request"]


@pytest.mark.parametrize("status", [400, 503])
def test_every_refusal_body_is_openai_shaped(status):
    tokens = 3000 if status == 400 else 1500
    error = refusal_for(tokens, "words", _limit(), 2000, "prompt").body["error"]
    assert {"message", "type", "param", "code"} <= set(error) and isinstance(error["message"], str)


def test_a_prompt_over_a_mebibyte_is_answered_by_its_words_without_a_slow_count():
    upstream = _Upstream(count=250_000, max_model_len=200_000)
    refusal, _, _ = _admit({"prompt": "wwwwwwww " * 150_000}, upstream)  # 1.35 MB, 150,000 words
    assert refusal.status == 503 and refusal.body["error"]["prompt_tokens_counted_by"] == "words"
    assert upstream.calls == ["/v1/models"]
