"""What the pre-call hook asks a deployment's engine, as the guard does: /tokenize's count, /v1/models' cards."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from telemetry.catalogue.fields import GUARD_UPSTREAM_ERROR, GUARD_UPSTREAM_UNAVAILABLE
from telemetry.guard.prompt import PromptSize
from telemetry.guard.refusal import MODELS_PATH, Refusal, error_body

# The engine tokenizes a long prompt in about a second per MB on a busy node (BENCHMARKS.md, the lab's
# /tokenize); the scrape timeout would cut that short.
TOKENIZE_TIMEOUT_S = 30.0


def _headers(deployment: Mapping[str, Any]) -> dict[str, str]:
    key = (deployment.get("litellm_params") or {}).get("api_key")
    return {"Authorization": f"Bearer {key}"} if isinstance(key, str) and key else {}


async def tokenize(root: str, deployment: Mapping[str, Any], size: PromptSize,
                   timeout_s: float = TOKENIZE_TIMEOUT_S) -> int:
    """The engine's count of the prompt plus what /tokenize does not take; a Refusal (502 or the engine's own
    answer) when it gives none."""
    assert size.tokenize_body is not None
    try:
        async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
            answer = await client.post(f"{root}/tokenize", json=size.tokenize_body, headers=_headers(deployment))
    except httpx.HTTPError as exc:
        raise Refusal(502, error_body(GUARD_UPSTREAM_UNAVAILABLE, f"memtel: the upstream could not count the "
                                      f"prompt's tokens (/tokenize): {type(exc).__name__}: {exc}", 502)) from None
    count = None
    if answer.status_code == 200:
        try:
            count = answer.json().get("count")
        except (ValueError, AttributeError):
            count = None
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise Refusal(502, error_body(GUARD_UPSTREAM_ERROR, f"memtel: the upstream's /tokenize answered "
                                      f"{answer.status_code} without a token count", 502))
    return count + size.counted_tokens


async def fetch_models(root: str, deployment: Mapping[str, Any], timeout_s: float) -> tuple[int, bytes]:
    """One GET of the engine's /v1/models: (status, body), for refusal.ContextLength."""
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
        answer = await client.get(f"{root}{MODELS_PATH}", headers=_headers(deployment))
    return answer.status_code, answer.content



__all__ = ["fetch_models", "tokenize"]
