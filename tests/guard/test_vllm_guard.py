"""Real vLLM on CPU behind the guard: what passes is what going direct gives, and /tokenize counts as vLLM does.

The session's counting vLLM server (tests/support/vllm_shared.py: the tiny random-weight Llama of
tests/support/vllm.py, whose WordLevel tokenizer makes one word one token, with a plain chat template; its
memtel hook counts the attention calls in the worker, which the guard does not look at), the guard in this
process. The hook the guard scrapes is a static exposition (tests/guard/servers.py): the tiny Llama has no
sparse-attention indexer, so the live forecast has nothing to compute; the limit (3,000 tokens) makes the guard
both forward by its byte bound and ask vLLM's /tokenize. Sampling is greedy, so two answers to one request are
the same but for ids and times.
"""

from __future__ import annotations

import copy
import http.client
import json

import pytest

from tests.guard.servers import RunningGuard, StubHook, exposition, request
from tests.support.vllm import VOCAB_WORDS

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LIMIT = 3000
VOLATILE = ("id", "created", "system_fingerprint")


@pytest.fixture(scope="module")
def vllm(vllm_counting):
    return vllm_counting.server


@pytest.fixture(scope="module")
def guard(vllm):
    hook = StubHook(lambda: exposition(LIMIT, node="cpu", rank="0"))
    running = RunningGuard(vllm.url, [hook.url])
    running.wait_for(lambda: running.tracker.published is not None)
    yield running
    running.stop()
    hook.stop()


def _words(n: int, offset: int = 0) -> str:
    return " ".join(VOCAB_WORDS[(offset + i) % len(VOCAB_WORDS)] for i in range(n))


def _without_volatile(value):
    if isinstance(value, dict):
        return {k: _without_volatile(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_without_volatile(v) for v in value]
    return value


def _events(url: str, path: str, body: dict) -> list:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        events = []
        for line in response.read().decode().splitlines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else _without_volatile(json.loads(data)))
        return events
    finally:
        conn.close()


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"model": "tiny", "prompt": _words(40), "max_tokens": 6, "temperature": 0}),
    ("/v1/completions", {"model": "tiny", "prompt": _words(1500, 7), "max_tokens": 4, "temperature": 0}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": _words(30, 3)}],
                              "max_tokens": 5, "temperature": 0}),
], ids=["completion-by-bytes", "completion-by-tokenize", "chat"])
def test_a_non_streamed_answer_is_the_same_as_going_direct(vllm, guard, path, body):
    direct = request(vllm.url, "POST", path, body, timeout=120)
    via = request(guard.url, "POST", path, body, timeout=120)
    assert (via[0], direct[0]) == (200, 200), via[2]
    assert _without_volatile(json.loads(via[2])) == _without_volatile(json.loads(direct[2]))
    assert via[1]["content-type"] == direct[1]["content-type"]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"model": "tiny", "prompt": _words(50), "max_tokens": 8, "temperature": 0,
                         "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": _words(20, 9)}],
                              "max_tokens": 8, "temperature": 0, "stream": True}),
], ids=["completion", "chat"])
def test_a_streamed_answer_is_the_same_as_going_direct(vllm, guard, path, body):
    direct = _events(vllm.url, path, body)
    via = _events(guard.url, path, body)
    assert _answer(via) == _answer(direct) and via[-1] == "[DONE]" and len(via) >= 3


def _answer(events: list) -> tuple[list, str]:
    """A stream as its reader gets the answer: the events without their text, consecutive equal ones as one, and the
    whole text. vLLM puts several tokens in one event when its reader lags (its output collector merges the deltas,
    the last one with the finish reason too), which happens on a loaded machine with or without a proxy; that the
    guard passes a stream byte for byte is tests/guard/test_proxy.py's
    `test_a_stream_reaches_the_client_chunk_by_chunk_and_byte_for_byte`."""
    shapes: list = []
    text = ""
    for event in events:
        if event != "[DONE]":
            event = copy.deepcopy(event)
            choice = (event.get("choices") or [{}])[0]
            holder, key = (choice["delta"], "content") if isinstance(choice.get("delta"), dict) else (choice, "text")
            piece = holder.pop(key, None)
            text += piece if isinstance(piece, str) else ""
        if not shapes or shapes[-1] != event:
            shapes.append(event)
    return shapes, text


def test_the_guard_counts_with_vllms_tokenize_and_refuses_over_the_limit(vllm, guard):
    tokenize = guard.sample("memtel_guard_tokenize_calls_total") or 0
    # 2,990 words: over the byte bound, under the word bound, so vLLM counts: 2,990 tokens fit.
    status, _, _ = request(guard.url, "POST", "/v1/completions",
                           {"model": "tiny", "prompt": _words(2990), "max_tokens": 1}, timeout=120)
    assert status == 200
    assert guard.sample("memtel_guard_tokenize_calls_total") == tokenize + 1
    # Chat: the template allowance sends it to vLLM's /tokenize with the messages, which counts the template.
    chat = {"model": "tiny", "messages": [{"role": "user", "content": _words(2999)}], "max_tokens": 1}
    status, _, data = request(guard.url, "POST", "/v1/chat/completions", chat, timeout=120)
    error = json.loads(data)["error"]
    assert status == 503 and error["prompt_tokens_counted_by"] == "tokenize"
    assert error["prompt_tokens"] == 2999 + 2  # "user", the words, "assistant"
    status, _, data = request(guard.url, "POST", "/v1/completions", {"model": "tiny", "prompt": _words(3001)})
    # Over the limit by its words; its bytes could reach max-model-len, so vLLM counts: transient.
    assert status == 503 and json.loads(data)["error"]["prompt_tokens_counted_by"] == "tokenize"
    # Words at vLLM's max-model-len (its /v1/models says it) or over: permanent, a 400 without a count.
    max_model_len = json.loads(request(vllm.url, "GET", "/v1/models")[2])["data"][0]["max_model_len"]
    status, headers, data = request(guard.url, "POST", "/v1/completions",
                                    {"model": "tiny", "prompt": _words(max_model_len)})
    error = json.loads(data)["error"]
    assert (status, error["code"], error["max_model_len"], headers["x-should-retry"]) == (
        400, "context_length_exceeded", max_model_len, "false")
    assert error["prompt_tokens_counted_by"] == "words" and max_model_len > LIMIT


def test_models_health_and_vllms_own_errors_pass_through(vllm, guard):
    for method, path, body in (("GET", "/v1/models", None), ("GET", "/health", None),
                               ("POST", "/tokenize", {"model": "tiny", "prompt": _words(5)}),
                               ("POST", "/v1/completions", {"model": "nope", "prompt": "ka"}),
                               ("POST", "/v1/completions", {"model": "tiny", "prompt": "ka", "max_tokens": -1})):
        direct = request(vllm.url, method, path, body, timeout=60)
        via = request(guard.url, method, path, body, timeout=60)
        assert via[0] == direct[0], (path, via)
        assert _without_volatile(json.loads(via[2] or b"null")) == _without_volatile(json.loads(direct[2] or b"null"))
