"""The refusals' bodies, said the way OpenAI clients read them (the pure part: telemetry/admission/refusal.py)."""

from __future__ import annotations

import json

from telemetry.catalogue.fields import GUARD_BAD_REQUEST, GUARD_WOULD_NOT_FIT
from telemetry.guard.limit import Limit, RankFit
from telemetry.guard.prompt import PromptSize
from telemetry.guard.refusal import MAX_MODELS_BYTES, behind, parse_models, uncountable

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
