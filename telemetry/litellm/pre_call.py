"""`MemtelPreCall`: memtel's gate (gate.py) as a LiteLLM proxy pre-call hook.

For each request, the hook finds the deployments its model names in LiteLLM's router (the model group, a
deployment's id, a deployment's `litellm_params.model`, aliases and wildcards as the router resolves them) and
asks the gate, which performs the admission core's decisions (gate.py): passed, the request goes on untouched;
admitted, it is pinned to the gate's deployment (metadata `memtel_deployment`, read by routing.py) with the key
of its hold (metadata `memtel_hold`); refused,
the gate's `Refusal` is raised as LiteLLM's `ProxyException` (refusals.py): a permanent misfit or a request the
gate cannot size or attribute is a 400 with `x-should-retry: false`, a transient one a 503 with `Retry-After`
after it was held up to `MEMTEL_LITELLM_HOLD_S`. A client that leaves while its prompt is held ends the hold at
once (client.py): nothing goes upstream, LiteLLM logs a 499.

A call that LiteLLM could not connect to its deployment for (its failure event) takes that deployment out of
the gate's pool: the client's retry is decided over the others.

A refusal is logged by LiteLLM in one line: LiteLLM logs a 5xx with its traceback, which for a refusal says
nothing (`OneLineRefusals`, a filter on LiteLLM's proxy logger, drops it for the gate's own refusals).

Configured by environment (gauges.GateSettings): MEMTEL_LITELLM_HOLD_S (10), MEMTEL_LITELLM_STALE_S (15),
MEMTEL_LITELLM_RESERVE_MB (0), MEMTEL_LITELLM_TIMEOUT_S (2). A bad value stops the proxy's start with one line
(`settings_or_exit`); a good start says in one line that the callbacks are loaded.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from fastapi import HTTPException
from litellm.constants import LITELLM_CLIENT_DISCONNECT_DETAIL
from litellm.integrations.custom_logger import CustomLogger
from litellm.proxy._types import ProxyException

from telemetry.admission.refusal import Refusal
from telemetry.errors import ConfigError, printable
from telemetry.litellm import client
from telemetry.litellm.gate import HOLD_KEY, ClientLeft, Gate, named_deployments
from telemetry.litellm.gauges import ENV, PIN_KEY, GateSettings, GaugeBook, deployment_id
from telemetry.litellm.metrics import GateMetrics
from telemetry.litellm.refusals import proxy_exception_kwargs

# What LiteLLM adds to a request's data before the hook: never part of the client's prompt.
_LITELLM_KEYS = ("metadata", "litellm_metadata", "proxy_server_request", "litellm_call_id", "litellm_logging_obj",
                 "secret_fields", "user_api_key_dict")
_METADATA = ("metadata", "litellm_metadata")
CLIENT_CLOSED = 499  # LiteLLM's own status for a client that left (nginx's "client closed request")
PROXY_LOGGER = "LiteLLM Proxy"  # litellm._logging.verbose_proxy_logger
REFUSAL_MARK = "memtel_refusal"  # set on the gate's ProxyExceptions: OneLineRefusals knows them by it
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


class OneLineRefusals(logging.Filter):
    """LiteLLM's proxy logs each 5xx it answers with its traceback (20 lines of LiteLLM's own frames); for the
    gate's refusal that is noise: its record keeps its one line, without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if getattr(exc, REFUSAL_MARK, False):
            record.exc_info, record.exc_text = None, None
        return True


BOOK = GaugeBook(settings_or_exit())  # one per proxy process: the routing strategy reads the same gauges
GATE = Gate(BOOK)
client.show(GateMetrics(GATE))  # GET /memtel/metrics, and /health's blind header
client.install()  # a client is seen leaving, a hold ends with its request (in a LiteLLM proxy)
logging.getLogger(PROXY_LOGGER).addFilter(OneLineRefusals())


def request_body(data: dict[str, Any]) -> dict[str, Any]:
    """The client's request as the engine would see it: the proxy's snapshot of the body, else `data` without
    what LiteLLM added."""
    snapshot = (data.get("proxy_server_request") or {}).get("body")
    body = snapshot if isinstance(snapshot, dict) else data
    return {k: v for k, v in body.items() if k not in _LITELLM_KEYS}


def connection_refused(exception: object) -> bool:
    """Whether LiteLLM's call failed because its deployment could not be reached (nothing was sent to it)."""
    seen: set[int] = set()
    stack = [exception]
    while stack:
        current = stack.pop()
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, ConnectionRefusedError) or type(current).__name__ in ("ConnectError",
                                                                                       "APIConnectionError"):
            return True
        stack.extend(getattr(current, attr, None) for attr in ("__cause__", "__context__", "original_exception"))
    return False


def _metadata(data: dict[str, Any], key: str) -> object:
    for where in (data, data.get("litellm_params") or {}):
        for name in _METADATA:
            found = (where.get(name) or {}).get(key) if isinstance(where.get(name) or {}, dict) else None
            if found is not None:
                return found
    return None


class MemtelPreCall(CustomLogger):  # type: ignore[misc]  # LiteLLM ships no type information
    def __init__(self, gate: Gate = GATE, router: Any = None) -> None:
        super().__init__()
        self.gate = gate
        self.router = router  # None: the proxy's llm_router

    def _router(self) -> Any:
        if self.router is not None:
            return self.router
        from litellm.proxy import proxy_server

        return proxy_server.llm_router

    async def async_pre_call_hook(self, user_api_key_dict: Any, cache: Any, data: dict[str, Any],
                                  call_type: str) -> dict[str, Any]:
        for name in _METADATA:  # the hold's key is the gate's to give
            if isinstance(data.get(name), dict):
                data[name].pop(HOLD_KEY, None)
        deployments, any_guarded = named_deployments(self._router(), data.get("model"))
        try:
            admitted = await self.gate.decide(str(call_type), request_body(data), deployments, any_guarded)
        except Refusal as refusal:
            error = ProxyException(**proxy_exception_kwargs(refusal))
            setattr(error, REFUSAL_MARK, True)
            raise error from None
        except ClientLeft as held:
            log.warning("memtel: the client left after %s s held; its prompt is not sent (litellm_call_id=%s)",
                        held, data.get("litellm_call_id"))
            raise HTTPException(status_code=CLIENT_CLOSED, detail=LITELLM_CLIENT_DISCONNECT_DETAIL) from None
        if admitted is None:
            return data
        metadata = data.get("metadata")
        if not isinstance(metadata, dict):
            metadata = data["metadata"] = {}
        pinned = deployment_id(admitted.deployment)
        if pinned is not None:
            metadata[PIN_KEY] = pinned
        metadata[HOLD_KEY] = admitted.hold_key
        return data

    async def async_log_success_event(self, kwargs: dict[str, Any], response_obj: Any, start_time: Any,
                                      end_time: Any) -> None:
        self.gate.release(_metadata(kwargs, HOLD_KEY))

    async def async_log_failure_event(self, kwargs: dict[str, Any], response_obj: Any, start_time: Any,
                                      end_time: Any) -> None:
        self.gate.release(_metadata(kwargs, HOLD_KEY))
        exception = kwargs.get("exception")
        if connection_refused(exception):
            info = (kwargs.get("litellm_params") or {}).get("model_info") or {}
            deployment = info.get("id") if isinstance(info, dict) else None
            self.gate.leave(deployment or _metadata(kwargs, PIN_KEY),
                            f"LiteLLM could not connect to it: {printable(str(exception), 200)}")

    async def async_post_call_failure_hook(self, request_data: dict[str, Any], original_exception: Exception,
                                           user_api_key_dict: Any, traceback_str: str | None = None) -> None:
        self.gate.release(_metadata(request_data, HOLD_KEY))


memtel_pre_call = MemtelPreCall()  # config.yaml: litellm_settings.callbacks: telemetry.litellm.pre_call.memtel_pre_call
log.warning("memtel: the LiteLLM gate's callbacks are loaded (%s)",
            ", ".join(f"{ENV[name]}={getattr(BOOK.settings, name):g}" for name in ENV))

__all__ = ["BOOK", "GATE", "MemtelPreCall", "OneLineRefusals", "connection_refused", "memtel_pre_call",
           "request_body", "settings_or_exit"]
