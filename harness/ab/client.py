"""The streaming client: one request, timed, never raising.

TTFT is the time from sending the request to the first streamed chunk that carries content
(text for /v1/completions, delta.content for /v1/chat/completions); end-to-end latency runs to the
end of the stream. Token counts come from the server's usage block (`stream_options.include_usage`).
Any failure (refused connection, HTTP error, timeout, a stream cut because the server died) becomes
`RequestResult(ok=False, error=...)`, so a ladder goes on; the caller decides whether the arm stops.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from harness.ab.config import RequestSettings


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    status_code: int | None = None
    started_at: float = 0.0          # unix seconds
    ended_at: float = 0.0
    ttft_s: float | None = None      # client side: request sent -> first content chunk
    e2e_s: float | None = None
    usage_prompt_tokens: int | None = None  # the server's usage.prompt_tokens
    output_tokens: int | None = None  # usage.completion_tokens, else the content chunks counted
    content_chunks: int = 0
    text: str = ""
    finish_reason: str | None = None


@dataclass
class Tokenizer:
    """Counts tokens with the server's /tokenize, exactly as the server will count the request."""

    client: httpx.Client
    base_url: str
    model: str
    api: str = "completions"
    calls: int = field(default=0)
    seconds: float = field(default=0.0)  # spent in /tokenize calls (request to decoded answer)
    max_model_len: int | None = None

    def count(self, text: str) -> int:
        if self.api == "chat":
            body = {"model": self.model, "messages": [{"role": "user", "content": text}], "add_generation_prompt": True}
        else:
            body = {"model": self.model, "prompt": text}
        self.calls += 1
        started = time.perf_counter()
        try:
            return self._count(body)
        finally:
            self.seconds += time.perf_counter() - started

    def _count(self, body: dict) -> int:
        response = self.client.post(self.base_url + "/tokenize", json=body, timeout=300.0)
        if response.status_code != 200:
            raise RuntimeError(f"{self.base_url}/tokenize answered {response.status_code}: {response.text[:300]}")
        data = response.json()
        self.max_model_len = data.get("max_model_len", self.max_model_len)
        return int(data["count"])


def request_body(api: str, model: str, prompt: str, settings: RequestSettings) -> dict:
    body: dict = {
        "model": model,
        "max_tokens": settings.max_tokens,
        "temperature": settings.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body.update(settings.extra_body)
    return body


def _chunk_content(api: str, chunk: dict) -> tuple[str, str | None]:
    text, finish = "", None
    for choice in chunk.get("choices") or []:
        if api == "chat":
            text += (choice.get("delta") or {}).get("content") or ""
        else:
            text += choice.get("text") or ""
        finish = choice.get("finish_reason") or finish
    return text, finish


def stream_request(client: httpx.Client, base_url: str, model: str, prompt: str,
                   settings: RequestSettings) -> RequestResult:
    api = settings.api
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    body = request_body(api, model, prompt, settings)
    # Encoded before the clock starts: a 200k-token body is over a megabyte of JSON.
    request_bytes = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    result = RequestResult(ok=False, started_at=time.time())
    # A long prefill sends nothing for minutes: the read timeout is the whole request's timeout.
    timeout = httpx.Timeout(settings.timeout_s, connect=10.0)
    deadline = time.perf_counter() + settings.timeout_s
    start = time.perf_counter()
    parts: list[str] = []
    try:
        with client.stream("POST", base_url + path, content=request_bytes, headers=headers,
                           timeout=timeout) as response:
            result.status_code = response.status_code
            if response.status_code != 200:
                response.read()
                result.error = f"HTTP {response.status_code}: {response.text[:500]}"
                return result
            for line in response.iter_lines():
                if time.perf_counter() > deadline:
                    raise httpx.ReadTimeout(f"request exceeded timeout_s={settings.timeout_s}")
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    result.error = f"server error in stream: {json.dumps(chunk['error'])[:500]}"
                    return result
                text, finish = _chunk_content(api, chunk)
                if text:
                    if result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - start
                    result.content_chunks += 1
                    parts.append(text)
                result.finish_reason = finish or result.finish_reason
                usage = chunk.get("usage")
                if usage:
                    result.usage_prompt_tokens = usage.get("prompt_tokens")
                    result.output_tokens = usage.get("completion_tokens")
        result.e2e_s = time.perf_counter() - start
        if result.finish_reason is None and result.usage_prompt_tokens is None:
            result.error = "stream ended without a finish reason or usage (server died mid-request?)"
        else:
            result.ok = True
    except (httpx.HTTPError, OSError, ValueError) as exc:  # ValueError: a broken JSON chunk
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    finally:
        result.ended_at = time.time()
        result.text = "".join(parts)
        if result.output_tokens is None and result.content_chunks:
            result.output_tokens = result.content_chunks
    return result
