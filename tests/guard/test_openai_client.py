"""The guard's refusals as the real OpenAI Python client and httpx meet them, against a real guard on loopback.

A prompt over the engine's max-model-len (its /v1/models says 2,000; the rank takes 1,000 now) is permanent:
the client raises BadRequestError at once, without retrying (the review's 503 made it retry for 20 s). A
prompt within max-model-len but over the limit now is transient: 503 with Retry-After and x-should-retry.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest

from tests.guard.servers import RunningGuard, StubHook, StubUpstream, exposition

LIMIT = 1000
MAX_MODEL_LEN = 2000
REJECTED = "memtel_guard_rejected_total"


@pytest.fixture(scope="module")
def upstream():
    server = StubUpstream()
    server.max_model_len = MAX_MODEL_LEN
    yield server
    server.stop()


@pytest.fixture(scope="module")
def guard(upstream):
    hook = StubHook(lambda: exposition(LIMIT, node="node-a", rank="0", budget=1_610_612_736,
                                       growth={4000: 1_482_686_464}))
    running = RunningGuard(upstream.url, [hook.url])
    running.wait_for(lambda: running.tracker.published is not None)
    yield running
    running.stop()
    hook.stop()


def _posts(upstream):
    return [p for p in upstream.paths() if p in ("/v1/completions", "/v1/chat/completions")]


def _call(client, chat: bool, stream: bool, words: int):
    if chat:
        return client.chat.completions.create(model="stub", messages=[{"role": "user", "content": "w " * words}],
                                              max_tokens=4, stream=stream)
    return client.completions.create(model="stub", prompt="w " * words, max_tokens=4, stream=stream)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_prompt_over_max_model_len_is_a_bad_request_at_once_without_retries(guard, upstream, mode, stream, chat):
    before = guard.sample(REJECTED, {"reason": "context_length_exceeded"}) or 0
    upstream.seen.clear()
    started = time.perf_counter()
    with pytest.raises(openai.BadRequestError) as caught:  # the client's default max_retries=2 stays untouched
        if mode == "sync":
            with openai.OpenAI(base_url=guard.url + "/v1", api_key="k") as client:
                _call(client, chat, stream, 3 * MAX_MODEL_LEN)
        else:
            async def run():
                async with openai.AsyncOpenAI(base_url=guard.url + "/v1", api_key="k") as client:
                    await _call(client, chat, stream, 3 * MAX_MODEL_LEN)
            asyncio.run(run())
    assert time.perf_counter() - started < 1.0
    error = caught.value
    assert error.status_code == 400 and error.code == "context_length_exceeded"
    assert error.response.headers["x-should-retry"] == "false" and "retry-after" not in error.response.headers
    assert guard.sample(REJECTED, {"reason": "context_length_exceeded"}) == before + 1  # one request: no retry
    assert _posts(upstream) == []  # the engine never saw it


def test_httpx_reads_a_permanent_refusal_whole(guard, upstream):
    response = httpx.post(guard.url + "/v1/completions", json={"model": "stub", "prompt": "w " * 2500}, timeout=5)
    assert response.status_code == 400 and response.headers["content-type"] == "application/json"
    assert response.headers["x-should-retry"] == "false" and "retry-after" not in response.headers
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "context_length_exceeded",
                                                               "prompt")
    assert (error["prompt_tokens"], error["prompt_tokens_counted_by"], error["max_model_len"]) == (2500, "words",
                                                                                                     MAX_MODEL_LEN)
    assert (error["limit_tokens"], error["rank"], error["node"]) == (LIMIT, "0", "node-a")


def test_a_prompt_that_does_not_fit_now_is_transient_and_says_so(guard, upstream):
    response = httpx.post(guard.url + "/v1/completions", json={"model": "stub", "prompt": "w " * 1500}, timeout=5)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "10" and response.headers["x-should-retry"] == "true"
    error = response.json()["error"]
    assert (error["type"], error["reason"], error["retryable"]) == ("memtel_would_not_fit", "would_not_fit", True)
    assert (error["limit_tokens"], error["limit_tokens_at_best"]) == (LIMIT, MAX_MODEL_LEN)
    # forecast_bytes (1.38 GiB) is below the budget (1.50 GiB): the words say why it still does not fit.
    assert error["forecast_bytes"] < error["fit_budget_bytes"]
    assert "its peak during the prefill exceeds it" in error["forecast"]
    with openai.OpenAI(base_url=guard.url + "/v1", api_key="k", max_retries=0) as client, \
            pytest.raises(openai.InternalServerError) as caught:
        client.completions.create(model="stub", prompt="w " * 1500, max_tokens=4)
    assert caught.value.status_code == 503


def test_a_prompt_that_fits_is_served_to_the_openai_client(guard, upstream):
    with openai.OpenAI(base_url=guard.url + "/v1", api_key="k") as client:
        answer = client.completions.create(model="stub", prompt="w " * 10, max_tokens=4)
    assert answer.choices[0].text == "alpha beta gamma delta"


def test_one_word_and_many_spaces_holds_one_token_so_a_normal_request_beside_it_is_admitted(guard, upstream):
    """The review's padded prompt held its 400,000 bytes for its whole generation while a normal request was
    refused `in_prefill`: now it is counted first and holds what its prefill needs."""
    upstream.hold = threading.Event()  # the stub answers no completion until the test lets it
    statuses = []

    def post(prompt):
        statuses.append(httpx.post(guard.url + "/v1/completions", json={"model": "stub", "prompt": prompt},
                                   timeout=10).status_code)

    padded = threading.Thread(target=post, args=("word" + " " * 600,))
    normal = threading.Thread(target=post, args=("w " * 500,))  # 500 tokens: over the 394 left beside 606
    try:
        padded.start()
        guard.wait_for(lambda: guard.tracker.in_prefill_tokens > 0)
        assert guard.tracker.in_prefill_tokens == 1  # its count, not its 606 bytes and special tokens
        normal.start()
        guard.wait_for(lambda: guard.tracker.in_prefill_tokens == 1 + 500)  # both admitted, both in prefill
    finally:
        upstream.hold.set()
        for thread in (padded, normal):
            if thread.ident is not None:  # started
                thread.join(10)
        upstream.hold = None
    assert statuses == [200, 200]
