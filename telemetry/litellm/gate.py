"""The gate: what memtel decides for one request that reaches a LiteLLM proxy, without LiteLLM.

`Gate.decide` takes the call's type, the client's body and the deployments its model names (pre_call.py finds
them in LiteLLM's router) and either passes it untouched (a model of no guarded deployment), admits it to one
deployment holding its tokens (`Admitted`), or raises a `Refusal`. The decisions are the admission core's
(telemetry/admission): one `Admission` per set of deployments a model names, over one `Replica` per deployment
(shared by every set: their readings, holds and pool membership are one), and the gate only performs them:
`CountFirst` asks the deployment's /tokenize, `ReadModels` its /v1/models, `Hold` waits until the core wakes the
prompt (a hook answered, a hold was released), its deadline (`MEMTEL_LITELLM_HOLD_S`) or its client leaving,
`Forward` pins the request to the replica's deployment, a refusal is raised. It fails closed:

- a model that names no deployment while the proxy guards some (a typo, a name LiteLLM would route past the
  gate) is refused (400): the gate cannot say where it would go;
- a call to a guarded deployment whose route the gate does not size (`/v1/messages`, embeddings) is refused
  (400), as is a body it cannot size (`PromptError`: the guard's own 400);
- a deployment that refuses a connection (/tokenize, its hook, LiteLLM's own call) leaves the pool
  (gauges.GaugeBook.leave, mirrored into the core's pool) and the prompt is decided again over the others; none
  left: 503 `no_replica` with Retry-After.

Holds are keyed by a secret the gate draws (`HOLD_KEY` in the request's metadata, any value the client sent
there dropped), never by a client-chosen call id, and end on the first of: LiteLLM's success or failure event,
its failure hook, and the end of the HTTP request itself (client.py's `ClientWatch` runs `on_end` callbacks
however the request ended: answered, streamed to the end, abandoned mid-stream, or its client gone). Every
admission holds, 0 tokens included, so every one is released once.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from telemetry.admission import (
    Admission,
    CountFirst,
    Forward,
    Hold,
    Prompt,
    PromptError,
    ReadModels,
    Refusal,
    Replica,
    Settings,
    measure,
    parse_models,
)
from telemetry.admission.prompt import CHAT_COMPLETIONS, COMPLETIONS, RESPONSES
from telemetry.admission.waiting import HeldPrompts, now
from telemetry.guard.limit import LimitTracker
from telemetry.litellm import client
from telemetry.litellm.gauges import GaugeBook, deployment_hooks, deployment_id, upstream_root
from telemetry.litellm.refusals import bad_request
from telemetry.litellm.upstream import Unreachable, Upstreams, served_model

# LiteLLM's call types whose prompt the gate sizes, and the route whose body they carry.
SIZED = {"completion": CHAT_COMPLETIONS, "acompletion": CHAT_COMPLETIONS,
         "text_completion": COMPLETIONS, "atext_completion": COMPLETIONS,
         "responses": RESPONSES, "aresponses": RESPONSES}
HOLD_KEY = "memtel_hold"  # the request's metadata: the key of its hold, drawn by the gate
MAX_HELD = 256  # prompts waiting for room at once (the core's queue); more: a 503 at once


class ClientLeft(Exception):
    """The client of a held prompt closed its connection; nothing was sent upstream (str: seconds held)."""


@dataclass(frozen=True)
class Admitted:
    """Where the prompt goes and the key of its hold."""

    deployment: dict[str, Any]
    hold_key: str


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
        self.held: dict[str, tuple[Admission, Forward]] = {}
        self.refusals: dict[str, int] = {}  # refusals by reason (the core's counted_as), for metrics.py
        self._replicas: dict[str, Replica] = {}  # deployment key -> its replica, shared by every admission
        self._deployments: dict[str, dict[str, Any]] = {}  # replica name -> its deployment
        self._admissions: dict[tuple[str, ...], Admission] = {}
        self.held_prompts = HeldPrompts(lambda: self._admissions.values())
        self._loop: asyncio.AbstractEventLoop | None = None

    async def decide(self, call_type: str, body: dict[str, Any], deployments: Sequence[dict[str, Any]],
                     any_guarded: bool, gone: Callable[[], Awaitable[None]] = client.left) -> Admitted | None:
        """Pass (None), admit (Admitted) or refuse (Refusal) one request; ClientLeft if its client leaves while it
        is held. `deployments`: those its model names; `any_guarded`: whether any deployment of the proxy names
        hooks."""
        try:
            return await self._decide(call_type, body, deployments, any_guarded, gone)
        except Refusal as refusal:
            reason = refusal.counted_as or refusal.reason or f"http_{refusal.status}"
            self.refusals[reason] = self.refusals.get(reason, 0) + 1
            raise

    async def _decide(self, call_type: str, body: dict[str, Any], deployments: Sequence[dict[str, Any]],
                      any_guarded: bool, gone: Callable[[], Awaitable[None]]) -> Admitted | None:
        model = body.get("model")
        if not deployments:
            if any_guarded and (model is not None or call_type in SIZED):
                raise bad_request(f"the model {str(model)[:100]!r} names no deployment of this proxy; ask for a "
                                  f"model group (model_list's model_name)", "model", "unknown_model")
            return None
        guarded = [d for d in deployments if deployment_hooks(d)]
        if not guarded:
            return None  # no deployment it names is guarded (a hosted API)
        path = SIZED.get(call_type)
        if path is None:
            raise bad_request(f"this route ({call_type}) is not sized by the gate and the model's deployments are "
                              f"guarded; send the prompt to /v1/chat/completions, /v1/completions or /v1/responses",
                              None, "unsized_route")
        try:
            prompt = Prompt(measure(path, body))
        except PromptError as error:
            raise bad_request(str(error), "messages" if path == CHAT_COMPLETIONS else "prompt") from None
        admission = await self._admission(guarded)
        return await self._perform(admission, prompt, gone)

    # -- the core's decisions, performed ---------------------------------------------------------------------
    async def _perform(self, admission: Admission, prompt: Prompt, gone: Callable[[], Awaitable[None]]) -> Admitted:
        started = time.monotonic()
        leaving: asyncio.Future[None] | None = None  # the client leaving, watched from the first hold on
        try:
            while True:
                self._sync_pool(admission)
                if not any(r.healthy for r in admission.replicas):
                    raise admission.no_replica().refusal
                decision = admission.decide(prompt, now())
                if isinstance(decision, Forward):
                    return self._forwarded(admission, decision)
                if isinstance(decision, CountFirst):
                    await self._count(admission, prompt, decision)
                elif isinstance(decision, ReadModels):
                    await self._read_models(admission, decision.replica)
                elif isinstance(decision, Hold):
                    leaving = leaving or asyncio.ensure_future(gone())
                    try:
                        waited = await self.held_prompts.wait(prompt, decision.deadline, leaving)
                    except asyncio.CancelledError:  # the request's app call cancelled: the prompt is not held
                        admission.leave(prompt, now())
                        self.kick()
                        if not client.has_left():
                            raise
                        # ClientWatch cancelled it for the client's leaving: said as that, the cancel answered
                        uncancel = getattr(asyncio.current_task(), "uncancel", None)  # Python 3.11 on
                        if uncancel is not None:
                            uncancel()
                        raise ClientLeft(f"{time.monotonic() - started:.2f}") from None
                    if not waited:
                        admission.leave(prompt, now())
                        self.kick()
                        raise ClientLeft(f"{time.monotonic() - started:.2f}")
                else:
                    raise decision.refusal
        finally:
            if leaving is not None:
                leaving.cancel()

    def _forwarded(self, admission: Admission, forward: Forward) -> Admitted:
        key = secrets.token_urlsafe(16)
        self.held[key] = (admission, forward)
        client.on_end(functools.partial(self.release, key))  # whatever ends the request ends its hold
        return Admitted(self._deployments[forward.replica.name], key)

    async def _count(self, admission: Admission, prompt: Prompt, ask: CountFirst) -> None:
        deployment = self._deployments[ask.replica.name]
        body = dict(ask.body)
        body["model"] = served_model(deployment) or body.get("model")
        try:
            prompt.counted(await self.upstreams.count(upstream_root(deployment) or "", deployment, body))
        except Refusal as refusal:
            prompt.not_counted(refusal)
        except Unreachable as exc:  # nothing reached it: out of the pool, decided again over the others
            self._leave(ask.replica, str(exc))

    async def _read_models(self, admission: Admission, replica: Replica) -> None:
        deployment = self._deployments[replica.name]
        try:
            status, data = await self.upstreams.fetch_models(upstream_root(deployment) or "", deployment,
                                                             self.book.settings.timeout_s)
        except Exception:  # unknown max-model-len: a refusal is transient, never a failure of its own
            status, data = 0, b""
        admission.models_read(replica, (parse_models(data) or None) if status == 200 else None, now())

    def kick(self) -> None:
        """The limit may have risen (a hook answered, a hold was released, a replica came back): the held prompts
        the cores name are decided again on the loop's next turn."""
        self.held_prompts.kick()

    # -- replicas and the pool -------------------------------------------------------------------------------
    async def _admission(self, deployments: list[dict[str, Any]]) -> Admission:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # the book starts again on a new loop (tests start several); so does the gate
            self._replicas.clear()
            self._deployments.clear()
            self._admissions.clear()
            self.held.clear()
            self._loop = loop
        rooms = await self.book.rooms(deployments)  # the trackers, each hook's first answer awaited
        replicas = []
        for room in rooms:
            key = deployment_id(room.deployment) or f"{upstream_root(room.deployment)} {id(room.tracker)}"
            replica = self._replicas.get(key)
            if replica is None or replica.readings is not room.tracker:
                replica = self._replicas[key] = Replica(key, room.tracker)
                room.tracker.subscribe(self.kick)
            self._deployments[key] = room.deployment
            replicas.append(replica)
        names = tuple(r.name for r in replicas)
        found = self._admissions.get(names)
        if found is None:
            settings = Settings(when_blind="admit", queue_s=self.book.settings.hold_s, max_queued=MAX_HELD)
            found = self._admissions[names] = Admission(replicas, settings)
        return found

    def _sync_pool(self, admission: Admission) -> None:
        """The core's pool as the book has it: a deployment that refused a connection is out until its hooks have
        answered again (GaugeBook.left)."""
        for replica in admission.replicas:
            assert isinstance(replica.readings, LimitTracker)
            why = self.book.left(replica.readings)
            if why is not None and replica.healthy:
                admission.pool.leave(replica, why)
            elif why is None and not replica.healthy:
                admission.pool.back(replica)
                self.kick()

    def _leave(self, replica: Replica, why: str) -> None:
        assert isinstance(replica.readings, LimitTracker)
        self.book.leave(replica.readings, why)
        replica.healthy, replica.health_error = False, why

    async def aclose(self) -> None:
        """Stop the scrapes and close the engines' connections (a test's end; a proxy keeps its gate)."""
        self.book.close()
        await self.upstreams.aclose()

    def release(self, key: object) -> None:
        """The hold's prefill is over (the call ended, however): once, whatever calls it first."""
        held = self.held.pop(key, None) if isinstance(key, str) else None
        if held is not None:
            admission, forward = held
            admission.release(forward, now())
            self.kick()

    def leave(self, deployment: object, reason: str) -> None:
        """LiteLLM could not connect to a deployment (its id): out of the pool, as /tokenize's refusal does."""
        replica = self._replicas.get(deployment) if isinstance(deployment, str) else None
        if replica is not None:
            self._leave(replica, reason)

    def trackers(self) -> dict[str, LimitTracker]:
        """Each deployment the gate has met (its id) and its readings, for metrics.py."""
        return {name: replica.readings for name, replica in self._replicas.items()
                if isinstance(replica.readings, LimitTracker)}

    def in_pool(self, deployment: dict[str, Any]) -> bool:
        found = deployment_id(deployment)
        replica = self._replicas.get(found) if found is not None else None
        return replica is None or self.book.left(replica.readings) is None  # type: ignore[arg-type]


__all__ = ["HOLD_KEY", "MAX_HELD", "SIZED", "Admitted", "ClientLeft", "Gate", "named_deployments"]
