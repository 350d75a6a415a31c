"""What the gate asks a deployment's engine, as the guard does: /tokenize's count, /v1/models' cards.

One kept-alive httpx client per engine (`Upstreams`): a burst of prompts that need /tokenize reuses the
connections it opened instead of opening one per prompt (a new connection per call lost 17 of 32 to
`ReadError` under a 32-prompt burst). /tokenize is asked with the deployment's own model (`served_model`: its
`litellm_params.model` without the provider prefix), never the model group the client named, which the engine
does not know. An engine that refuses the connection raises `Unreachable`: the gate takes the deployment out of
its pool and decides again.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import httpx

from telemetry.admission.refusal import MAX_MODELS_BYTES, MODELS_PATH, Refusal, error_body
from telemetry.catalogue.fields import GUARD_UPSTREAM_ERROR, GUARD_UPSTREAM_UNAVAILABLE
from telemetry.litellm.refusals import GATE

# The engine tokenizes a long prompt in about a second per MB on a busy node (BENCHMARKS.md, the lab's
# /tokenize); the scrape timeout would cut that short.
TOKENIZE_TIMEOUT_S = 30.0
# vLLM's answer lists the prompt's token ids (about 8 bytes each): a 1M-token prompt's is ~8 MB.
MAX_TOKENIZE_ANSWER_BYTES = 64 << 20
# At most this many connections to one engine at once: a burst of counts waits for a kept-alive one instead of
# opening a connection each (an engine's listen backlog can be small: Python's http.server's is 5).
CONNECTIONS_PER_ENGINE = 16


class Unreachable(Exception):
    """The engine refused the connection (str: why): nothing reached it, another deployment may take the prompt."""


def served_model(deployment: Mapping[str, Any]) -> str | None:
    """The engine's own name of the model: `litellm_params.model` without its provider (`openai/lab` -> `lab`)."""
    model = (deployment.get("litellm_params") or {}).get("model")
    if not isinstance(model, str) or not model:
        return None
    return model.split("/", 1)[1] if "/" in model else model


def _headers(deployment: Mapping[str, Any]) -> dict[str, str]:
    key = (deployment.get("litellm_params") or {}).get("api_key")
    return {"Authorization": f"Bearer {key}"} if isinstance(key, str) and key else {}


class Upstreams:
    """One kept-alive client per engine root, on the loop that made it."""

    def __init__(self) -> None:
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def client(self, root: str) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a client's connections belong to one loop (tests start several)
            self._clients.clear()
            self._loop = loop
        found = self._clients.get(root)
        if found is None:
            limits = httpx.Limits(max_connections=CONNECTIONS_PER_ENGINE,
                                  max_keepalive_connections=CONNECTIONS_PER_ENGINE)
            # No timeout of httpx's own (its 5 s for a free connection would fail a burst): each call has one
            # deadline over its whole exchange.
            found = self._clients[root] = httpx.AsyncClient(trust_env=False, limits=limits, timeout=None)
        return found

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for found in clients:
            await found.aclose()

    async def count(self, root: str, deployment: Mapping[str, Any], body: Mapping[str, Any],
                    timeout_s: float = TOKENIZE_TIMEOUT_S) -> int:
        """The engine's /tokenize `count` of `body` (asked with the deployment's own model); a Refusal (502) when it
        gives none; Unreachable when the engine refuses the connection."""
        body = {**body, "model": served_model(deployment) or body.get("model")}

        async def ask() -> tuple[int, bytes | None]:
            async with self.client(root).stream("POST", f"{root}/tokenize", json=body,
                                                headers=_headers(deployment)) as answer:
                return answer.status_code, await _read_capped(answer, MAX_TOKENIZE_ANSWER_BYTES)

        async def ask_again_on_a_closed_connection() -> tuple[int, bytes | None]:
            try:
                return await ask()
            except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
                return await ask()  # a kept-alive connection the engine had closed: once more (/tokenize is safe)

        try:
            status, data = await asyncio.wait_for(ask_again_on_a_closed_connection(), timeout_s)
        except httpx.ConnectError as exc:
            raise Unreachable(f"{root}/tokenize: {type(exc).__name__}: {exc}"[:300]) from None
        except (httpx.HTTPError, asyncio.TimeoutError, ValueError) as exc:
            said = "no whole answer in time" if isinstance(exc, asyncio.TimeoutError) else "the connection failed"
            why = f"{type(exc).__name__}: {str(exc) or said}"[:300]
            raise Refusal(502, error_body(GUARD_UPSTREAM_UNAVAILABLE, f"{GATE}: the upstream could not count the "
                                          f"prompt's tokens (/tokenize): {why}", 502)) from None
        count = await asyncio.to_thread(_count, data) if status == 200 and data is not None else None
        if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= 1 << 31:
            raise Refusal(502, error_body(GUARD_UPSTREAM_ERROR, f"{GATE}: the upstream's /tokenize answered "
                                          f"{status} without a token count", 502))
        return count

    async def fetch_models(self, root: str, deployment: Mapping[str, Any], timeout_s: float) -> tuple[int, bytes]:
        """One GET of the engine's /v1/models: (status, body), for refusal.ContextLength."""
        async def ask() -> tuple[int, bytes]:
            async with self.client(root).stream("GET", f"{root}{MODELS_PATH}", headers=_headers(deployment)) as answer:
                return answer.status_code, await _read_capped(answer, MAX_MODELS_BYTES) or b""

        return await asyncio.wait_for(ask(), timeout_s)


def _count(data: bytes) -> object:
    """/tokenize's `count` (parsed off the loop: the answer can be megabytes)."""
    try:
        found = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return found.get("count") if isinstance(found, dict) else None


async def _read_capped(answer: httpx.Response, most: int) -> bytes | None:
    """The answer's body, read at most `most` bytes far (None: it is longer)."""
    chunks, size = [], 0
    async for chunk in answer.aiter_bytes():
        size += len(chunk)
        if size > most:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


__all__ = ["Unreachable", "Upstreams", "served_model"]
