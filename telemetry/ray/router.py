"""`MemtelRequestRouter`: Ray Serve sends each prompt to the replica where it fits, by the admission core's decision.

Configured on the deployment whose replicas run the engines (docs/ray.md):

    @serve.deployment(request_router_config=RequestRouterConfig(
        request_router_class="telemetry.ray.router:MemtelRequestRouter",
        request_router_kwargs={"queue_s": 30}, request_routing_stats_period_s=1))

Serve calls `choose_replicas` for each request on the handle's router loop (in the proxy, or in the ingress that
calls the deployment). For a request whose first argument is an OpenAI completion or chat body (a dict, or
Ray Serve LLM's request model), the router sizes its prompt as the guard does (telemetry/admission/prompt.py) and
asks the core (fleet.py); the core's decision is performed here:

- Forward to replica R: the router ranks R alone, its tokens held until Serve reports the request finished;
- Hold: the routing task waits (a prompt that does not fit any replica now) until the core wakes it or its wait
  (`queue_s`) ends;
- a refusal (400 that no retry cures: over max-model-len or what the deployment could take at best; 503 with
  Retry-After): the request's routing future gets `RouterRefusal`, which Serve raises in the caller, who answers it
  (refusal.py).

A request that is not a prompt (another method, another argument), and every request of a deployment whose
replicas name no hooks in their routing stats, is routed by Ray's default (power of two choices).
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from telemetry.admission import Forward, PromptError, error_body
from telemetry.catalogue.fields import GUARD_BAD_REQUEST
from telemetry.errors import ConfigError
from telemetry.ray.fleet import Fleet, RouterSettings
from telemetry.ray.refusal import RouterRefusal
from telemetry.ray.request import prompt_size, request_body

log = logging.getLogger("ray.serve")  # Serve writes its logger into the replica's log

ROUTER_CLASS = "telemetry.ray.router:MemtelRequestRouter"


def router_config(request_routing_stats_period_s: float = 1.0, **kwargs: Any) -> RequestRouterConfig:
    """Serve's `RequestRouterConfig` for this router, its `request_router_kwargs` checked now (ConfigError, one line)
    rather than at the first request. The routing stats are asked for every second: they name the hooks."""
    RouterSettings.from_kwargs(kwargs)
    return RequestRouterConfig(request_router_class=ROUTER_CLASS, request_router_kwargs=kwargs,
                               request_routing_stats_period_s=request_routing_stats_period_s,
                               request_routing_stats_timeout_s=max(1.0, 2 * request_routing_stats_period_s))


class MemtelRequestRouter(PowerOfTwoChoicesRequestRouter):  # type: ignore[misc]  # Ray ships no type information
    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state()
        self._held: dict[str, Forward] = {}  # internal request id -> its Forward, until the request finishes
        self._broken: str | None = None
        self.fleet: Fleet | None = None
        try:
            self.fleet = Fleet(RouterSettings.from_kwargs(kwargs))
        except ConfigError as exc:  # Serve builds the router at the first request: raising here would hang them all
            self._broken = str(exc)
            log.error("memtel: %s; every prompt is refused until the deployment is fixed (router_config checks the "
                      "kwargs before a deploy)", exc)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        fleet = self.fleet
        if fleet is None:  # request_router_kwargs were refused: every prompt is answered with why
            if pending_request is not None and request_body(pending_request.args, pending_request.kwargs) is not None:
                return self._refuse(pending_request, candidate_replicas, RouterRefusal(
                    500, error_body(GUARD_BAD_REQUEST, f"memtel: the router is not configured: {self._broken}", 500)))
            return await self._default(candidate_replicas, pending_request)
        fleet.update([(str(r.replica_id.unique_id), r.routing_stats) for r in self.curr_replicas.values()])
        if pending_request is None or not fleet.watching:
            return await self._default(candidate_replicas, pending_request)
        body = request_body(pending_request.args, pending_request.kwargs)
        if body is None:
            return await self._default(candidate_replicas, pending_request)
        request_id = pending_request.metadata.internal_request_id
        self._release(request_id)  # Serve asks again when the replica it got refused the request
        try:
            size = prompt_size(body)
        except PromptError as exc:
            return self._refuse(pending_request, candidate_replicas, RouterRefusal(
                400, error_body(GUARD_BAD_REQUEST, f"memtel: {exc}", 400)))
        decision = await fleet.route(size)
        if not isinstance(decision, Forward):
            refusal = RouterRefusal(decision.status, decision.body, decision.headers)
            return self._refuse(pending_request, candidate_replicas, refusal)
        chosen = next((r for r in self.curr_replicas.values()
                       if str(r.replica_id.unique_id) == decision.replica.name), None)
        if chosen is None:  # it left Serve while the prompt was decided: decide again after Serve's backoff
            fleet.release(decision)
            pending_request.routing_context.should_backoff = True
            return []
        self._held[request_id] = decision
        return [[chosen]]

    async def _default(self, candidates: list[RunningReplica],
                       pending: PendingRequest | None) -> list[list[RunningReplica]]:
        """Ray's own choice (power of two choices)."""
        ranked: list[list[RunningReplica]] = await super().choose_replicas(candidates, pending)
        return ranked

    def _refuse(self, pending: PendingRequest, candidates: list[RunningReplica],
                refusal: RouterRefusal) -> list[list[RunningReplica]]:
        """End the request with `refusal` (Serve raises it in the caller). One candidate is returned so that Serve's
        routing loop looks at the request again, sees it done and stops."""
        if not pending.future.done():
            pending.future.set_exception(refusal)
        return [candidates[:1]] if candidates else []

    def _release(self, request_id: str) -> None:
        forward = self._held.pop(request_id, None)
        if forward is not None and self.fleet is not None:
            self.fleet.release(forward)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self._release(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        if self.fleet is not None:
            self.fleet.left(str(replica_id.unique_id), "its actor died")

    def on_replica_actor_unavailable(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_unavailable(replica_id)
        if self.fleet is not None:
            self.fleet.left(str(replica_id.unique_id), "its actor is unavailable")

__all__ = ["ROUTER_CLASS", "MemtelRequestRouter", "router_config"]
