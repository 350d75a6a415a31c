"""The router's refusal crosses Serve as an exception and is answered by the ingress with the core's answer."""

from __future__ import annotations

import pickle

from telemetry.ray.refusal import RouterRefusal, refusal_answer

BODY = {"error": {"message": "memtel: no", "type": "invalid_request_error", "code": "context_length_exceeded"}}


def test_the_ingress_answers_the_refusal_it_finds_in_the_call_s_exception() -> None:
    refusal = RouterRefusal(400, BODY, (("x-should-retry", "false"),))
    assert refusal.status_code == 400 and str(refusal) == "memtel: no"  # Ray Serve LLM answers its status_code
    assert refusal_answer(refusal) == (400, BODY, {"x-should-retry": "false"})
    wrapped = RuntimeError("the call failed")
    wrapped.__cause__ = refusal
    assert refusal_answer(wrapped) == (400, BODY, {"x-should-retry": "false"})
    assert refusal_answer(ValueError("another error")) is None


def test_the_refusal_crosses_a_process_as_itself() -> None:
    copy = pickle.loads(pickle.dumps(RouterRefusal(503, BODY, (("Retry-After", "10"),))))
    assert isinstance(copy, RouterRefusal) and refusal_answer(copy) == (503, BODY, {"Retry-After": "10"})
