"""A guard Refusal said through LiteLLM's proxy: the keyword arguments of its `ProxyException`.

LiteLLM's proxy answers a `ProxyException` raised in a pre-call hook with its `code` as the HTTP status, its
`headers` as response headers (`x-should-retry`, `Retry-After` pass; framing and browser-security headers
are dropped) and the body `{"error": {"message", "type", "param", "code", "provider_specific_fields"}}`,
where `code` is always the HTTP status as a string: the OpenAI `code` a client tests
(`context_length_exceeded`) cannot stand there, so it goes into `provider_specific_fields.code`, with every
other field of the guard's body (the prompt's tokens, the limit, the rank and node, the forecast).
"""

from __future__ import annotations

from typing import Any

from telemetry.guard.refusal import Refusal

_OPENAI_KEYS = ("message", "type", "param", "code")


def proxy_exception_kwargs(refusal: Refusal) -> dict[str, Any]:
    """`ProxyException(**proxy_exception_kwargs(refusal))` answers what the guard would, as far as LiteLLM lets."""
    error = refusal.body["error"]
    fields = {"code": error.get("code"), **{k: v for k, v in error.items() if k not in _OPENAI_KEYS}}
    return {"message": error["message"], "type": error["type"], "param": error.get("param"), "code": refusal.status,
            "headers": dict(refusal.headers), "provider_specific_fields": fields}


__all__ = ["proxy_exception_kwargs"]
