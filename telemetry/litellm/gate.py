"""The gate: what memtel decides for one request that reaches a LiteLLM proxy, without LiteLLM.

`Gate.decide` takes the call's type, the client's body and the deployments its model names (pre_call.py finds
them in LiteLLM's router) and either passes it untouched (a model of no guarded deployment), admits it to one
deployment holding its tokens (`Admitted`), or raises a `Refusal`. It fails closed:

- a model that names no deployment while the proxy guards some (a deployment id, `openai/<name>`, a typo) is
  refused (400): the gate cannot say where it would go;
- a call to a guarded deployment whose route the gate does not size (`/v1/messages`, `/v1/responses`,
  embeddings) is refused (400), as is a body it cannot size (`PromptError`: the guard's own 400);
- a deployment that refuses a connection (/tokenize, its hook) leaves the pool (gauges.GaugeBook.leave) and the
  prompt is decided again over the others; none left: 503 `no_replica` with Retry-After.

Holds are keyed by a secret the gate draws (`HOLD_KEY` in the request's metadata, any value the client sent
there dropped), never by a client-chosen call id, and end on the first of: LiteLLM's success or failure event,
its failure hook, and the end of the HTTP request itself (client.py's `ClientWatch` runs `on_end` callbacks
however the request ended: answered, streamed to the end, abandoned mid-stream, or its client gone). Every
admission holds, 0 tokens included, so every one is released once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from telemetry.catalogue.fields import GUARD_UPSTREAM_UNAVAILABLE
from telemetry.guard.admission import admit
from telemetry.guard.at_best import AtBest, deployment_at_best
from telemetry.guard.limit import LimitTracker
from telemetry.guard.prompt import CHAT_COMPLETIONS, COMPLETIONS, PromptError, measure
from telemetry.guard.refusal import RETRY_AFTER_S, Refusal, error_body
from telemetry.litellm import client
from telemetry.litellm.gauges import GaugeBook, Room, deployment_hooks, deployment_id, roomiest, upstream_root
from telemetry.litellm.refusals import GATE, bad_request
from telemetry.litellm.upstream import Unreachable, Upstreams, served_model

# LiteLLM's call types whose prompt the gate sizes, and the route whose body they carry.
SIZED = {"completion": CHAT_COMPLETIONS, "acompletion": CHAT_COMPLETIONS,
         "text_completion": COMPLETIONS, "atext_completion": COMPLETIONS}
HOLD_KEY = "memtel_hold"  # the request's metadata: the key of its hold, drawn by the gate


class ClientLeft(Exception):
    """The client of a held prompt closed its connection; nothing was sent upstream (str: seconds held)."""


@dataclass(frozen=True)
class Hold:
    tracker: LimitTracker
    tokens: int


@dataclass(frozen=True)
class Admitted:
    """Where the prompt goes (None: the router's choice, the gate blind) and the key of its hold (None: none)."""

    deployment: dict[str, Any] | None
    hold_key: str | None


def no_replica(reasons: Sequence[str]) -> Refusal:
    retry_after = RETRY_AFTER_S["no_replica"]
    message = (f"{GATE}: every deployment of the model group is out of the pool ({'; '.join(reasons)[:400]}); "
               f"retry in {retry_after} s")
    return Refusal(503, error_body(GUARD_UPSTREAM_UNAVAILABLE, message, 503, reason="no_replica", retryable=True),
                   retry_after, reason="no_replica")


def group_at_best(rooms: list[Room], deployments: int) -> tuple[AtBest | None, str | None]:
    """The model group's at-best limit, as the guard's over its replicas (the permanent 400's rule, at_best.py);
    unknown while a deployment of the group names no hooks or is out of the pool (nothing says what it could
    take)."""
    if len(rooms) != deployments:
        return None, "a deployment of the model group names no memtel hooks"
    if any(room.left is not None for room in rooms):
        return None, "a deployment of the model group is out of the pool"
    return deployment_at_best([room.tracker for room in rooms])


def named_deployments(router: Any, model: object) -> tuple[list[dict[str, Any]], bool]:
    """The deployments `model` names in `router` (its group, aliases and wildcards as the router resolves them,
    a deployment's id, a deployment's `litellm_params.model`), and whether any deployment of the router is
    guarded."""
    every = list(getattr(router, "model_list", None) or []) if router is not None else []
    any_guarded = any(deployment_hooks(d) for d in every)
    if router is None or not isinstance(model, str):
        return [], any_guarded
    found = list(router.get_model_list(model_name=model) or [])
    found += [d for d in every if deployment_id(d) == model or (d.get("litellm_params") or {}).get("model") == model]
    unique: dict[object, dict[str, Any]] = {}
    for deployment in found:
        unique.setdefault(deployment_id(deployment) or id(deployment), deployment)
    return list(unique.values()), any_guarded


class Gate:
    def __init__(self, book: GaugeBook, upstreams: Upstreams | None = None) -> None:
        self.book = book
        self.upstreams = upstreams or Upstreams()
        self.held: dict[str, Hold] = {}
        self._trackers: dict[str, LimitTracker] = {}  # deployment id -> its tracker (to leave the pool by id)

    async def decide(self, call_type: str, body: dict[str, Any], deployments: Sequence[dict[str, Any]],
                     any_guarded: bool, gone: Callable[[], Awaitable[None]] = client.left) -> Admitted | None:
        """Pass (None), admit (Admitted) or refuse (Refusal) one request; ClientLeft if its client leaves while it
        is held. `deployments`: those its model names; `any_guarded`: whether any deployment of the proxy names
        hooks."""
        model = body.get("model")
        if not deployments:
            if any_guarded and (model is not None or call_type in SIZED):
                raise bad_request(f"the model {str(model)[:100]!r} names no deployment of this proxy; ask for a "
                                  f"model group (model_list's model_name)", "model", "unknown_model")
            return None
        if not any(deployment_hooks(d) for d in deployments):
            return None  # no deployment it names is guarded (a hosted API)
        path = SIZED.get(call_type)
        if path is None:
            raise bad_request(f"this route ({call_type}) is not sized by the gate and the model's deployments are "
                              f"guarded; send the prompt to /v1/chat/completions or /v1/completions", None,
                              "unsized_route")
        try:
            size = measure(path, body)
        except PromptError as error:
            raise bad_request(str(error), "messages" if path == CHAT_COMPLETIONS else "prompt") from None
        return await self._admit(size, list(deployments), gone)

    async def _admit(self, size: Any, deployments: list[dict[str, Any]],
                     gone: Callable[[], Awaitable[None]]) -> Admitted:
        settings = self.book.settings
        started = time.monotonic()
        deadline = started + settings.hold_s
        leaving: asyncio.Future[None] | None = None  # the client leaving, watched from the first wait on
        try:
            while True:
                rooms = await self.book.rooms(deployments)
                for room in rooms:
                    if (found := deployment_id(room.deployment)) is not None:
                        self._trackers[found] = room.tracker
                if rooms and all(room.left is not None for room in rooms):
                    raise no_replica([room.left or "" for room in rooms])
                best = roomiest(rooms)
                if best is None:
                    return Admitted(None, None)  # all blind: pass, as --when-blind admit
                room = best
                deployment = room.deployment
                root = upstream_root(deployment) or ""
                sized = dataclasses.replace(size, model=served_model(deployment) or size.model)
                try:
                    tokens, counted_by = await admit(
                        sized, room.tracker, self.book.context(root),
                        tokenize=functools.partial(self.upstreams.tokenize, root, deployment, sized),
                        fetch_models=functools.partial(self.upstreams.fetch_models, root, deployment,
                                                       settings.timeout_s),
                        blind=lambda: (0, "blind"), rejected=lambda reason: None,
                        at_best=functools.partial(group_at_best, rooms, len(deployments)))
                except Unreachable as exc:
                    self.book.leave(room.tracker, str(exc))
                    continue  # decided again without it
                except Refusal as refusal:
                    left = deadline - time.monotonic()
                    if refusal.retry_after is not None and left > 0:  # held the whole hold_s, decided again at its end
                        leaving = leaving or asyncio.ensure_future(gone())
                        # the gauge moves once a scrape
                        await asyncio.wait((leaving,), timeout=min(settings.poll_s / 4, left))
                        if leaving.done():
                            raise ClientLeft(f"{time.monotonic() - started:.2f}") from None
                        continue
                    raise
                break
        finally:
            if leaving is not None:
                leaving.cancel()
        if counted_by == "blind":
            return Admitted(deployment, None)
        key = secrets.token_urlsafe(16)
        self.held[key] = Hold(room.tracker, tokens)
        client.on_end(functools.partial(self.release, key))  # whatever ends the request ends its hold
        return Admitted(deployment, key)

    async def aclose(self) -> None:
        """Stop the scrapes and close the engines' connections (a test's end; a proxy keeps its gate)."""
        self.book.close()
        await self.upstreams.aclose()

    def release(self, key: object) -> None:
        """The hold's prefill is over (the call ended, however): once, whatever calls it first."""
        held = self.held.pop(key, None) if isinstance(key, str) else None
        if held is not None:
            held.tracker.release(held.tokens)

    def leave(self, deployment: object, reason: str) -> None:
        """LiteLLM could not connect to a deployment (its id): out of the pool, as /tokenize's refusal does."""
        tracker = self._trackers.get(deployment) if isinstance(deployment, str) else None
        if tracker is not None:
            self.book.leave(tracker, reason)

    def in_pool(self, deployment: dict[str, Any]) -> bool:
        found = deployment_id(deployment)
        tracker = self._trackers.get(found) if found is not None else None
        return tracker is None or self.book.left(tracker) is None


__all__ = ["HOLD_KEY", "SIZED", "Admitted", "ClientLeft", "Gate", "Hold", "group_at_best", "named_deployments",
           "no_replica"]
