"""The refusals' bodies, said the way OpenAI clients read them (the pure part: telemetry/admission/refusal.py)."""

from __future__ import annotations

import json
import time

import pytest

from telemetry.admission.prompt import PromptSize
from telemetry.admission.readings import Limit, RankFit
from telemetry.admission.refusal import MAX_MODELS_BYTES, behind, forecast_words, parse_models, refusal_for, uncountable
from telemetry.catalogue.fields import GUARD_BAD_REQUEST, GUARD_WOULD_NOT_FIT

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


@pytest.mark.parametrize("status", [400, 503])
def test_every_refusal_body_is_openai_shaped(status):
    tokens = 3000 if status == 400 else 1500
    error = refusal_for(tokens, "words", _limit(), 2000, "prompt").body["error"]
    assert {"message", "type", "param", "code"} <= set(error) and isinstance(error["message"], str)



FIT = RankFit("0", "node-a", 1000, 8 << 30, None)


LIMIT = Limit(600, 1000, 400, FIT, "http://node-a:9200")


def test_waiting_behind_another_is_a_transient_refusal_naming_the_prompt_and_the_limit():
    refusal = behind(700, "words", LIMIT)
    error = refusal.body["error"]
    assert str(refusal) == error["message"]
    assert error == {"message": error["message"], "type": GUARD_WOULD_NOT_FIT, "param": None, "code": 503,
                     "reason": "in_prefill", "retryable": True, "prompt_tokens": 700,
                     "prompt_tokens_counted_by": "words", "limit_tokens": 600, "node": "node-a", "rank": "0",
                     "hook": "http://node-a:9200"}
    assert (refusal.status, refusal.headers, refusal.reason, refusal.counted_as) == \
        (503, (("Retry-After", "1"), ("x-should-retry", "true")), "in_prefill", "in_prefill")


def test_an_uncountable_prompt_is_a_permanent_bad_request():
    refusal = uncountable(PromptSize(5000, False, None, countable=False), LIMIT)
    error = refusal.body["error"]
    assert error == {"message": error["message"], "type": GUARD_BAD_REQUEST, "param": "prompt_embeds", "code": 400,
                     "reason": "uncountable", "retryable": False, "prompt_tokens": 5000,
                     "prompt_tokens_counted_by": "embedding_bytes", "limit_tokens": 600}
    assert (refusal.status, refusal.headers, refusal.reason) == (400, (("x-should-retry", "false"),), "bad_request")


def test_models_cards_that_are_not_objects_are_skipped_not_the_end():
    assert parse_models(json.dumps({"data": ["junk", {"id": "m", "max_model_len": 4096}]}).encode()) == {"m": 4096}


def test_a_models_answer_of_exactly_the_bound_is_read():
    data = json.dumps({"data": [{"id": "m", "max_model_len": 4096}]}).encode()
    assert parse_models(data.ljust(MAX_MODELS_BYTES)) == {"m": 4096}  # JSON allows the trailing spaces
    assert parse_models(data.ljust(MAX_MODELS_BYTES + 1)) == {}
