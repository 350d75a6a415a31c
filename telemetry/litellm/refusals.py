"""A refusal said through LiteLLM's proxy: the keyword arguments of its `ProxyException`.

LiteLLM's proxy answers a `ProxyException` raised in a pre-call hook with its `code` as the HTTP status, its
`headers` as response headers (`x-should-retry`, `Retry-After` pass; framing and browser-security headers
are dropped) and the body `{"error": {"message", "type", "param", "code", "provider_specific_fields"}}`,
where `code` is always the HTTP status as a string: the OpenAI `code` a client tests
(`context_length_exceeded`) cannot stand there, so it goes into `provider_specific_fields.code`, with every
other field of the refusal's body (the prompt's tokens, the limit, the rank and node, the forecast).

The message is named for the gate that refused (`GATE`), not for `memtel guard`, which the user did not run.
"""

from __future__ import annotations

from typing import Any

from telemetry.admission.refusal import Refusal, error_body
from telemetry.catalogue.fields import GUARD_BAD_REQUEST

GATE = "memtel's LiteLLM gate"
_GUARD = "memtel guard:"
_OPENAI_KEYS = ("message", "type", "param", "code")


def named(message: str) -> str:
    """The guard's refusal text, named for the gate."""
    return f"{GATE}:{message[len(_GUARD):]}" if message.startswith(_GUARD) else message


def bad_request(message: str, param: str | None = None, reason: str = "bad_request") -> Refusal:
    """A permanent 400 of the gate's own (a request it cannot size or attribute): no retry can help."""
    return Refusal(400, error_body(GUARD_BAD_REQUEST, f"{GATE}: {message}", 400, param=param, reason=reason,
                                   retryable=False), should_retry=False, reason=reason)


def proxy_exception_kwargs(refusal: Refusal) -> dict[str, Any]:
    """`ProxyException(**proxy_exception_kwargs(refusal))` answers what the guard would, as far as LiteLLM lets."""
    error = refusal.body["error"]
    fields = {"code": error.get("code"), **{k: v for k, v in error.items() if k not in _OPENAI_KEYS}}
    return {"message": named(error["message"]), "type": error["type"], "param": error.get("param"),
            "code": refusal.status, "headers": dict(refusal.headers), "provider_specific_fields": fields}


__all__ = ["GATE", "bad_request", "named", "proxy_exception_kwargs"]
