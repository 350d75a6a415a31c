"""`MemtelPreCall`: the guard's admission as a LiteLLM proxy pre-call hook.

For a completion or chat request to a model group whose deployments name memtel hooks, the hook sizes the
prompt (telemetry/guard/prompt.py), takes the deployment that can take the most now (gauges.roomiest) and
decides with the guard's own `admit` (telemetry/guard/admission.py): admitted, it pins the request to that
deployment (metadata `memtel_deployment`, read by routing.py) and holds its tokens until LiteLLM logs the
call's end; a permanent misfit (over max-model-len, or over the model group's at-best limit by the guard's rule:
telemetry/guard/at_best.py) is answered at once with the guard's 400 (`x-should-retry: false`); a
transient one waits, re-deciding every poll, up to `MEMTEL_LITELLM_HOLD_S`, then gets the guard's 503 with
`Retry-After`. A client that leaves while its prompt is held ends the hold at once (client.py): nothing goes
upstream, LiteLLM logs a 499. Blind (no fresh hook) it lets the request pass, as `memtel guard --when-blind
admit`.

Configured by environment (gauges.GateSettings): MEMTEL_LITELLM_HOLD_S (10), MEMTEL_LITELLM_STALE_S (15),
MEMTEL_LITELLM_RESERVE_MB (0), MEMTEL_LITELLM_TIMEOUT_S (2). A bad value stops the proxy's start with one line
(`settings_or_exit`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
import time
from typing import Any

from fastapi import HTTPException
from litellm.constants import LITELLM_CLIENT_DISCONNECT_DETAIL
from litellm.integrations.custom_logger import CustomLogger
from litellm.proxy._types import ProxyException

from telemetry.errors import ConfigError, printable
from telemetry.guard.admission import admit
from telemetry.guard.at_best import AtBest, deployment_at_best
from telemetry.guard.limit import LimitTracker
from telemetry.guard.prompt import CHAT_COMPLETIONS, COMPLETIONS, PromptError, measure
from telemetry.guard.refusal import Refusal
from telemetry.litellm import client, upstream
from telemetry.litellm.gauges import PIN_KEY, GateSettings, GaugeBook, Room, deployment_id, roomiest, upstream_root
from telemetry.litellm.refusals import proxy_exception_kwargs

PATHS = {"completion": CHAT_COMPLETIONS, "acompletion": CHAT_COMPLETIONS,
         "text_completion": COMPLETIONS, "atext_completion": COMPLETIONS}
# What LiteLLM adds to a request's data before the hook: never part of the client's prompt.
_LITELLM_KEYS = ("metadata", "litellm_metadata", "proxy_server_request", "litellm_call_id", "litellm_logging_obj",
                 "secret_fields", "user_api_key_dict")
CLIENT_CLOSED = 499  # LiteLLM's own status for a client that left (nginx's "client closed request")
log = logging.getLogger("memtel.litellm")


def settings_or_exit() -> GateSettings:
    """The settings from MEMTEL_LITELLM_*; a bad value ends this process with one line on stderr, exit 2.

    LiteLLM imports callbacks inside the app's startup, where any exception (SystemExit included) is printed
    with its traceback by Starlette's lifespan and uvicorn; refusing every request instead would leave a proxy
    that answers its health checks and fails all traffic. Ending the process before it serves is the one way
    to say it in one line."""
    try:
        return GateSettings.from_env()
    except ConfigError as error:
        sys.stderr.write(f"memtel: {printable(str(error), 1000)}\n")
        sys.stderr.flush()
        os._exit(ConfigError.exit_code)


BOOK = GaugeBook(settings_or_exit())  # one per proxy process: the routing strategy reads the same gauges
client.install()  # a held prompt's client is seen leaving (in a LiteLLM proxy; nothing to do elsewhere)


def request_body(data: dict[str, Any]) -> dict[str, Any]:
    """The client's request as the engine would see it: the proxy's snapshot of the body, else `data` without
    what LiteLLM added."""
    snapshot = (data.get("proxy_server_request") or {}).get("body")
    body = snapshot if isinstance(snapshot, dict) else data
    return {k: v for k, v in body.items() if k not in _LITELLM_KEYS}


def group_at_best(rooms: list[Room], deployments: int) -> tuple[AtBest | None, str | None]:
    """The model group's at-best limit, as the guard's over its replicas (the permanent 400's rule, at_best.py);
    unknown while a deployment of the group names no hooks (nothing says what it could take)."""
    if len(rooms) != deployments:
        return None, "a deployment of the model group names no memtel hooks"
    return deployment_at_best([room.tracker for room in rooms])


class MemtelPreCall(CustomLogger):  # type: ignore[misc]  # LiteLLM ships no type information
    def __init__(self, book: GaugeBook = BOOK, router: Any = None) -> None:
        super().__init__()
        self.book = book
        self.router = router  # None: the proxy's llm_router
        self.held: dict[str, tuple[LimitTracker, int]] = {}

    def _deployments(self, model: object) -> list[dict[str, Any]]:
        router = self.router
        if router is None:
            from litellm.proxy import proxy_server

            router = proxy_server.llm_router
        if router is None or not isinstance(model, str):
            return []
        return list(router.get_model_list(model_name=model) or [])

    async def async_pre_call_hook(self, user_api_key_dict: Any, cache: Any, data: dict[str, Any],
                                  call_type: str) -> dict[str, Any]:
        path = PATHS.get(str(call_type))
        deployments = self._deployments(data.get("model")) if path else []
        if path is None or not deployments:
            return data
        try:
            size = measure(path, request_body(data))
        except PromptError:
            return data  # LiteLLM or the engine answers a malformed request
        settings = self.book.settings
        started = time.monotonic()
        deadline = started + settings.hold_s
        gone: asyncio.Future[None] | None = None  # the client leaving, watched from the first wait on
        try:
            while True:
                rooms = await self.book.rooms(deployments)
                room = roomiest(rooms)
                if room is None:
                    return data  # no deployment with hooks, or all blind: pass, as --when-blind admit
                deployment = room.deployment
                root = upstream_root(deployment) or ""
                try:
                    tokens, _ = await admit(
                        size, room.tracker, self.book.context(root),
                        tokenize=functools.partial(upstream.tokenize, root, deployment, size),
                        fetch_models=functools.partial(upstream.fetch_models, root, deployment, settings.timeout_s),
                        blind=lambda: (0, "blind"), rejected=lambda reason: None,
                        at_best=functools.partial(group_at_best, rooms, len(deployments)))
                except Refusal as refusal:
                    left = deadline - time.monotonic()
                    if refusal.retry_after is not None and left > 0:   # held the whole hold_s, decided again at its end
                        gone = gone or asyncio.ensure_future(client.left())
                        # the gauge moves once a scrape
                        await asyncio.wait((gone,), timeout=min(settings.poll_s / 4, left))
                        if gone.done():
                            raise self._client_left(data, started) from None
                        continue
                    raise ProxyException(**proxy_exception_kwargs(refusal)) from None
                break
        finally:
            if gone is not None:
                gone.cancel()
        pinned = deployment_id(deployment)
        if pinned is not None:
            metadata = data.get("metadata")
            if not isinstance(metadata, dict):
                metadata = data["metadata"] = {}
            metadata[PIN_KEY] = pinned
        call_id = data.get("litellm_call_id")
        if isinstance(call_id, str) and tokens:
            self.held[call_id] = (room.tracker, tokens)
        elif tokens:
            room.tracker.release(tokens)  # nothing would release it
        return data

    @staticmethod
    def _client_left(data: dict[str, Any], started: float) -> HTTPException:
        """What ends a hold whose client left: LiteLLM's own answer to a client that left (logged as a 499
        failure, nothing sent upstream), after one line in the proxy's log."""
        log.warning("memtel: the client left after %.2f s held; its prompt is not sent (litellm_call_id=%s)",
                    time.monotonic() - started, data.get("litellm_call_id"))
        return HTTPException(status_code=CLIENT_CLOSED, detail=LITELLM_CLIENT_DISCONNECT_DETAIL)

    def _release(self, call_id: object) -> None:
        held = self.held.pop(call_id, None) if isinstance(call_id, str) else None
        if held is not None:
            held[0].release(held[1])

    async def async_log_success_event(self, kwargs: dict[str, Any], response_obj: Any, start_time: Any,
                                      end_time: Any) -> None:
        self._release(kwargs.get("litellm_call_id"))

    async def async_log_failure_event(self, kwargs: dict[str, Any], response_obj: Any, start_time: Any,
                                      end_time: Any) -> None:
        self._release(kwargs.get("litellm_call_id"))

    async def async_post_call_failure_hook(self, request_data: dict[str, Any], original_exception: Exception,
                                           user_api_key_dict: Any, traceback_str: str | None = None) -> None:
        self._release(request_data.get("litellm_call_id"))


memtel_pre_call = MemtelPreCall()  # config.yaml: litellm_settings.callbacks: telemetry.litellm.pre_call.memtel_pre_call

__all__ = ["BOOK", "PATHS", "MemtelPreCall", "memtel_pre_call", "request_body", "settings_or_exit"]
