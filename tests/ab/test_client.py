"""The streaming client: timings and counts from an SSE stream; every failure a result, never an exception.

The transport is injected (httpx.MockTransport) to produce the failures a real server rarely shows on
demand; the real-server path is covered by test_vllm_ladder.py.
"""

from __future__ import annotations

import json

import httpx

from harness.ab.client import stream_request
from harness.ab.config import RequestSettings


def sse(*chunks: dict, done: bool = True) -> bytes:
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks)
    return (body + ("data: [DONE]\n\n" if done else "")).encode()


def client_for(handler) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(handler))


def test_completion_stream_gives_ttft_usage_and_text():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        return httpx.Response(200, content=sse(
            {"choices": [{"text": "", "finish_reason": None}]},
            {"choices": [{"text": " 123", "finish_reason": None}]},
            {"choices": [{"text": "456", "finish_reason": "length"}]},
            {"choices": [], "usage": {"prompt_tokens": 4000, "completion_tokens": 2}},
        ), headers={"content-type": "text/event-stream"})

    result = stream_request(client_for(handler), "http://x", "tiny", "prompt text", RequestSettings(max_tokens=2))
    assert result.ok and result.error is None
    assert result.text == " 123456" and result.usage_prompt_tokens == 4000 and result.output_tokens == 2
    assert result.content_chunks == 2 and result.finish_reason == "length"
    assert result.ttft_s is not None and result.e2e_s is not None and 0 < result.ttft_s <= result.e2e_s
    assert seen["stream"] is True and seen["stream_options"] == {"include_usage": True}
    assert seen["prompt"] == "prompt text" and seen["temperature"] == 0.0


def test_chat_api_reads_delta_content():
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/chat/completions"
        assert json.loads(request.content)["messages"] == [{"role": "user", "content": "q"}]
        return httpx.Response(200, content=sse(
            {"choices": [{"delta": {"role": "assistant"}}]},
            {"choices": [{"delta": {"content": "42"}, "finish_reason": "stop"}]},
            {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}},
        ))

    result = stream_request(client_for(handler), "http://x", "m", "q", RequestSettings(api="chat"))
    assert result.ok and result.text == "42" and result.usage_prompt_tokens == 9


def test_http_error_is_recorded_with_the_body():
    def handler(request):
        return httpx.Response(400, json={"error": {"message": "prompt is longer than max_model_len 16384"}})

    result = stream_request(client_for(handler), "http://x", "m", "p", RequestSettings())
    assert not result.ok and result.status_code == 400
    assert result.error is not None and "HTTP 400" in result.error and "max_model_len" in result.error


def test_stream_cut_before_the_end_is_an_error():
    def handler(request):
        return httpx.Response(200, content=sse({"choices": [{"text": "a", "finish_reason": None}]}, done=False))

    result = stream_request(client_for(handler), "http://x", "m", "p", RequestSettings())
    assert not result.ok and result.error is not None and "server died mid-request" in result.error
    assert result.text == "a" and result.ttft_s is not None


def test_refused_connection_is_a_result_not_an_exception():
    def handler(request):
        raise httpx.ConnectError("connection refused", request=request)

    result = stream_request(client_for(handler), "http://x", "m", "p", RequestSettings())
    assert not result.ok and result.error is not None and result.error.startswith("ConnectError: connection refused")
    assert result.ended_at >= result.started_at
