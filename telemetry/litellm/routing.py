"""`MemtelRouting`: LiteLLM's router sends each prompt to the deployment where it fits now with the most room.

LiteLLM's proxy has no config key for a `CustomRoutingStrategyBase` (only `Router.set_custom_routing_strategy`,
which a router re-init undoes), but every `CustomLogger` callback may narrow the healthy deployments of a
group before the routing strategy picks (`async_filter_deployments`). This one leaves one deployment:

- never a deployment out of the gate's pool (it refused a connection), unless no other is left;
- the one the pre-call hook admitted the request to (metadata `memtel_deployment`), when it is healthy;
- else the deployment with hooks that can take the most now, if the prompt fits it by its words (a lower
  bound: the pre-call hook, not the router, refuses);
- else, where no deployment with hooks is seen or the prompt fits none, the group as LiteLLM gave it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from litellm.integrations.custom_logger import CustomLogger

from telemetry.admission.prompt import CHAT_COMPLETIONS, PromptError, measure
from telemetry.litellm.gate import Gate
from telemetry.litellm.gauges import PIN_KEY, GaugeBook, deployment_id, roomiest
from telemetry.litellm.pre_call import GATE


def pinned(request_kwargs: Mapping[str, Any] | None) -> str | None:
    for key in ("metadata", "litellm_metadata"):
        found = ((request_kwargs or {}).get(key) or {}).get(PIN_KEY)
        if isinstance(found, str):
            return found
    return None


class MemtelRouting(CustomLogger):  # type: ignore[misc]  # LiteLLM ships no type information
    def __init__(self, gate: Gate = GATE) -> None:
        super().__init__()
        self.gate = gate
        self.book: GaugeBook = gate.book

    async def async_filter_deployments(self, model: str, healthy_deployments: list[dict[str, Any]],
                                       messages: list[Any] | None, request_kwargs: dict[str, Any] | None = None,
                                       parent_otel_span: Any = None) -> list[dict[str, Any]]:
        healthy_deployments = [d for d in healthy_deployments if self.gate.in_pool(d)] or healthy_deployments
        chosen = pinned(request_kwargs)
        if chosen is not None:
            found = [d for d in healthy_deployments if deployment_id(d) == chosen]
            if found:
                return found
        try:
            words = measure(CHAT_COMPLETIONS, {"messages": messages or []}).least_tokens
        except PromptError:
            return healthy_deployments
        room = roomiest(await self.book.rooms(healthy_deployments), words)
        return [room.deployment] if room is not None else healthy_deployments


memtel_routing = MemtelRouting()  # config.yaml: litellm_settings.callbacks: telemetry.litellm.routing.memtel_routing

__all__ = ["MemtelRouting", "memtel_routing", "pinned"]
