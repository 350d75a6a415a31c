"""`MemtelPreCall`: the guard's admission as a LiteLLM proxy pre-call hook.

For a completion or chat request to a model group whose deployments name memtel hooks, the hook sizes the
prompt (telemetry/guard/prompt.py), takes the deployment that can take the most now (gauges.roomiest) and
decides with the guard's own `admit` (telemetry/guard/admission.py): admitted, it pins the request to that
deployment (metadata `memtel_deployment`, read by routing.py) and holds its tokens until LiteLLM logs the
call's end; a permanent misfit is answered at once with the guard's 400 (`x-should-retry: false`); a
transient one waits, re-deciding every poll, up to `MEMTEL_LITELLM_HOLD_S`, then gets the guard's 503 with
`Retry-After`. Blind (no fresh hook) it lets the request pass, as `memtel guard --when-blind admit`.

Configured by environment (gauges.GateSettings): MEMTEL_LITELLM_HOLD_S (10), MEMTEL_LITELLM_STALE_S (15),
MEMTEL_LITELLM_RESERVE_MB (0), MEMTEL_LITELLM_TIMEOUT_S (2).
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

from litellm.integrations.custom_logger import CustomLogger
from litellm.proxy._types import ProxyException

from telemetry.guard.admission import admit
from telemetry.guard.limit import LimitTracker
from telemetry.guard.prompt import CHAT_COMPLETIONS, COMPLETIONS, PromptError, measure
from telemetry.guard.refusal import Refusal
from telemetry.litellm import upstream
from telemetry.litellm.gauges import PIN_KEY, GateSettings, GaugeBook, deployment_id, roomiest, upstream_root
from telemetry.litellm.refusals import proxy_exception_kwargs

PATHS = {"completion": CHAT_COMPLETIONS, "acompletion": CHAT_COMPLETIONS,
         "text_completion": COMPLETIONS, "atext_completion": COMPLETIONS}
# What LiteLLM adds to a request's data before the hook: never part of the client's prompt.
_LITELLM_KEYS = ("metadata", "litellm_metadata", "proxy_server_request", "litellm_call_id", "litellm_logging_obj",
                 "secret_fields", "user_api_key_dict")
BOOK = GaugeBook(GateSettings.from_env())  # one per proxy process: the routing strategy reads the same gauges


def request_body(data: dict[str, Any]) -> dict[str, Any]:
    """The client's request as the engine would see it: the proxy's snapshot of the body, else `data` without
    what LiteLLM added."""
    snapshot = (data.get("proxy_server_request") or {}).get("body")
    body = snapshot if isinstance(snapshot, dict) else data
    return {k: v for k, v in body.items() if k not in _LITELLM_KEYS}


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
        deadline = time.monotonic() + settings.hold_s
        while True:
            room = roomiest(await self.book.rooms(deployments))
            if room is None:
                return data  # no deployment with hooks, or all blind: pass, as --when-blind admit
            deployment = room.deployment
            try:
                tokens, _ = await admit(
                    size, room.tracker, self.book.context(upstream_root(deployment) or ""),
                    tokenize=functools.partial(upstream.tokenize, upstream_root(deployment) or "", deployment, size),
                    fetch_models=functools.partial(upstream.fetch_models, upstream_root(deployment) or "", deployment,
                                                   settings.timeout_s),
                    blind=lambda: (0, "blind"), rejected=lambda reason: None)
            except Refusal as refusal:
                if refusal.retry_after is not None and time.monotonic() + settings.poll_s / 4 < deadline:
                    await asyncio.sleep(settings.poll_s / 4)  # the gauge moves once a scrape at most
                    continue
                raise ProxyException(**proxy_exception_kwargs(refusal)) from None
            break
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

__all__ = ["BOOK", "PATHS", "MemtelPreCall", "memtel_pre_call", "request_body"]
