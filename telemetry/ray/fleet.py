"""A Ray Serve deployment's replicas under the admission core: what they say, their hooks read, each prompt routed.

`Fleet` keeps one admission core (telemetry/admission) over the replicas Serve reports, each named by its replica
id and found from its routing stats (replica.py: `memtel_hooks`, `memtel_upstream`). It performs the core's
decisions and decides nothing itself:

- its scrape loop reads every replica's hooks every `poll_s` (httpx, kept-alive) and each replica's engine
  `/health`, and reports them to the core (`Readings.record_at`, `pool.leave` / `pool.back`), as `memtel guard`
  does; then it wakes the prompts the core names (`Admission.wake`);
- `route(size)` follows one prompt through the core's decisions: a `CountFirst` is asked of the replica's engine
  (`/tokenize`), a `ReadModels` of its `/v1/models`, a `Hold` waits until the core wakes it or its deadline; it
  returns the `Forward` (the caller sends the request there and calls `release` once it has finished) or the
  refusal.

A replica that names no hook, a hook that does not answer, a stale forecast: the core's rules (a replica without a
fresh limit is chosen only where none has one, and then `when_blind` decides). No Ray import: tested in-process.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from telemetry.admission import (
    Admission,
    CountFirst,
    Forward,
    Hold,
    HookReading,
    Prompt,
    PromptSize,
    Readings,
    ReadModels,
    Refusal,
    RefusePermanent,
    RefuseTransient,
    Replica,
    Settings,
    error_body,
    parse_hook,
    parse_models,
)
from telemetry.admission.core import SETTING_RANGES
from telemetry.admission.waiting import HeldPrompts, now
from telemetry.catalogue.fields import GUARD_UPSTREAM_ERROR, GUARD_UPSTREAM_UNAVAILABLE
from telemetry.errors import ConfigError
from telemetry.ray.replica import hooks_of, upstream_of
from telemetry.url import Endpoint, parse_url

log = logging.getLogger("ray.serve")  # the router runs in a Serve process: its log is the replica's
MAX_METRICS_BYTES = 4 << 20  # as the guard's: a hook's /metrics is tens of kB; a larger answer is not a hook's
TOKENIZE_TIMEOUT_S = 30.0  # an engine tokenizes a long prompt in about a second per MB on a busy node


@dataclass(frozen=True)
class RouterSettings:
    """The router's settings (`request_router_kwargs`), named as `memtel guard`'s flags."""

    queue_s: float = 30.0  # how long a prompt that does not fit now waits for room (the guard's --queue-s)
    max_queued: int = 32
    stale_s: float = 15.0
    reserve_mb: float = 0.0
    timeout_s: float = 2.0  # one scrape of a hook, one /health or /v1/models of an engine
    when_blind: str = "admit"

    @property
    def poll_s(self) -> float:
        return min(1.0, self.stale_s / 3)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> RouterSettings:
        """The settings from `request_router_kwargs`; ConfigError (one line) for an unknown key or a bad value."""
        known = {name: getattr(cls, name) for name in cls.__dataclass_fields__}
        values: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key not in known:
                raise ConfigError(f"request_router_kwargs: unknown key {key!r}; expected {', '.join(known)}")
            default = known[key]
            if isinstance(default, str):
                if value not in ("admit", "reject"):
                    raise ConfigError(f"request_router_kwargs.{key}: expected 'admit' or 'reject', got {value!r}")
            else:
                low, high = SETTING_RANGES[key]
                whole = isinstance(default, int)
                if (isinstance(value, bool) or not isinstance(value, int if whole else (int, float))
                        or not math.isfinite(value) or not low <= value <= high):
                    kind = "a whole number" if whole else "a finite number"
                    raise ConfigError(f"request_router_kwargs.{key}: expected {kind} from {low:g} to {high:g}, "
                                      f"got {value!r}")
            values[key] = value
        return cls(**values)


@dataclass
class Member:
    """One Serve replica as the core knows it: its `Replica` and where its engine answers (None: unknown)."""

    replica: Replica
    hooks: tuple[str, ...]
    upstream: str | None


class Fleet:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.members: dict[str, Member] = {}
        self.admission: Admission | None = None
        self.held_prompts = HeldPrompts(lambda: () if self.admission is None else (self.admission,))
        self._client: httpx.AsyncClient | None = None
        self._scraping: asyncio.Task[None] | None = None
        self._signature: tuple[object, ...] = ()

    # -- the replicas --------------------------------------------------------------------------------------------
    @property
    def watching(self) -> bool:
        """Whether any replica names hooks: otherwise the router leaves every choice to Ray's own."""
        return any(m.hooks for m in self.members.values())

    def update(self, replicas: Sequence[tuple[str, Mapping[str, Any] | None]]) -> None:
        """The replicas Serve runs now, each (replica id, its routing stats). A replica that keeps its hooks keeps
        its readings; one that left is gone from the core's pool."""
        signature = tuple((name, hooks_of(stats), upstream_of(stats)) for name, stats in replicas)
        if signature == self._signature:
            return
        self._signature = signature
        members: dict[str, Member] = {}
        for name, hooks, upstream in signature:
            hooks = hooks or ()
            known = self.members.get(name)
            if known is not None and known.hooks == hooks:
                known.upstream = upstream
                members[name] = known
                continue
            readings = Readings(_targets(hooks), stale_s=self.settings.stale_s,
                                reserve_bytes=self.settings.reserve_mb * (1 << 20))
            members[name] = Member(Replica(name, readings), hooks, upstream)
        self.members = members
        if self.admission is not None:
            self.admission.pool.replicas[:] = [m.replica for m in members.values()]
        elif members:
            self.admission = Admission([m.replica for m in members.values()],
                                       Settings(self.settings.when_blind, self.settings.queue_s,
                                                self.settings.max_queued))
        self._wake()

    def member(self, replica: Replica) -> Member | None:
        found = self.members.get(replica.name)
        return found if found is not None and found.replica is replica else None

    # -- one prompt ----------------------------------------------------------------------------------------------
    async def route(self, size: PromptSize) -> Forward | RefuseTransient | RefusePermanent:
        """Follow one prompt through the core's decisions to its Forward or its refusal."""
        self.start()
        await self.first_answers()
        admission = self.admission
        assert admission is not None
        prompt = Prompt(size)
        try:
            while True:
                decision = admission.decide(prompt, now())
                if isinstance(decision, CountFirst):
                    await self._count(prompt, decision)
                elif isinstance(decision, ReadModels):
                    found = await self._models(decision.replica)
                    admission.models_read(decision.replica, found, now())
                elif isinstance(decision, Hold):
                    await self.held_prompts.wait(prompt, decision.deadline)
                else:
                    return decision
        except asyncio.CancelledError:  # the caller gave up on the request while it waited
            admission.leave(prompt, now())
            raise

    def release(self, forward: Forward) -> None:
        """The forwarded request is over (Ray reports a request's end, not its first byte: the hold is longer than
        the prefill, never shorter). Once per Forward."""
        if self.admission is not None:
            self.admission.release(forward, now())
            self._wake()

    def left(self, name: str, why: str) -> None:
        """Serve found the replica's actor dead or unavailable: it leaves the pool until its engine answers."""
        found = self.members.get(name)
        if found is not None and self.admission is not None:
            self.admission.pool.leave(found.replica, why)

    # -- the engines' answers ----------------------------------------------------------------------------------
    async def _count(self, prompt: Prompt, decision: CountFirst) -> None:
        member = self.member(decision.replica)
        if member is None or member.upstream is None:
            prompt.not_counted(Refusal(502, error_body(
                GUARD_UPSTREAM_UNAVAILABLE, f"memtel: replica {decision.replica.name} names no engine for /tokenize "
                "(routing stats `memtel_upstream`: docs/ray.md)", 502)))
            return
        try:
            answer = await self.client().post(f"{member.upstream}/tokenize", json=decision.body,
                                              timeout=TOKENIZE_TIMEOUT_S)
        except httpx.HTTPError as exc:
            prompt.not_counted(Refusal(502, error_body(
                GUARD_UPSTREAM_UNAVAILABLE, f"memtel: the upstream could not count the prompt's tokens (/tokenize): "
                f"{type(exc).__name__}: {exc}", 502)))
            return
        count = None
        if answer.status_code == 200:
            try:
                count = answer.json().get("count")
            except (ValueError, AttributeError):
                count = None
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            prompt.not_counted(Refusal(502, error_body(
                GUARD_UPSTREAM_ERROR, f"memtel: the upstream's /tokenize answered {answer.status_code} without a "
                "token count", 502)))
            return
        prompt.counted(count)

    async def _models(self, replica: Replica) -> dict[str, int] | None:
        member = self.member(replica)
        if member is None or member.upstream is None:
            return None
        try:
            answer = await self.client().get(f"{member.upstream}/v1/models")
        except httpx.HTTPError:
            return None
        return (parse_models(answer.content) or None) if answer.status_code == 200 else None

    # -- the scrape loop -----------------------------------------------------------------------------------------
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.settings.timeout_s, trust_env=False)
        return self._client

    def start(self) -> None:
        """Start the scrape loop on the running loop, once (the first prompt waits for the first answers)."""
        if self._scraping is None:
            self._scraping = asyncio.get_running_loop().create_task(self._scrape_forever())

    async def first_answers(self) -> None:
        """Wait (at most the scrape timeout) until every hook answered once or failed: no prompt passes blind
        only because the router just started."""
        deadline = time.monotonic() + self.settings.timeout_s + 0.5
        while time.monotonic() < deadline and any(h.scraped_at is None and h.error is None
                                                  for m in self.members.values() for h in m.replica.readings.hooks):
            await asyncio.sleep(0.01)

    async def _scrape_forever(self) -> None:
        while True:
            started = time.monotonic()
            members = list(self.members.values())
            await asyncio.gather(*(self._scrape(m, h) for m in members for h in m.replica.readings.hooks),
                                 *(self._health(m) for m in members if m.upstream is not None))
            self._wake()
            await asyncio.sleep(max(0.0, self.settings.poll_s - (time.monotonic() - started)))

    async def _scrape(self, member: Member, hook: HookReading) -> None:
        headers = {"Authorization": hook.target.authorization} if hook.target.authorization else {}
        try:
            answer = await self.client().get(hook.target.url, headers=headers)
            if answer.status_code != 200:
                raise ValueError(f"answered HTTP {answer.status_code}")
            if len(answer.content) > MAX_METRICS_BYTES:
                raise ValueError(f"answered more than {MAX_METRICS_BYTES} bytes")
            fits, rejected = await asyncio.to_thread(parse_hook, answer.content.decode("utf-8", "replace"))
        except (httpx.HTTPError, ValueError) as exc:
            at = now()
            member.replica.readings.record_at(hook, None, f"{type(exc).__name__}: {exc}"[:200], None, *at)
        else:
            member.replica.readings.record_at(hook, fits, None, rejected, *now())

    async def _health(self, member: Member) -> None:
        """The engine's /health, as the guard reads each replica's: 200 brings it back, anything else leaves."""
        assert self.admission is not None
        try:
            answer = await self.client().get(f"{member.upstream}/health")
            why = None if answer.status_code == 200 else f"/health answered {answer.status_code}"
        except httpx.HTTPError as exc:
            why = f"/health: {type(exc).__name__}: {exc}"[:200]
        if why is None:
            self.admission.pool.back(member.replica)
        else:
            self.admission.pool.leave(member.replica, why)

    def _wake(self) -> None:
        """The limit may have risen: the held prompts the core names are decided again (at once: Serve calls in on
        the router's loop)."""
        self.held_prompts.pump()

    async def close(self) -> None:
        if self._scraping is not None:
            self._scraping.cancel()
            self._scraping = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _targets(hooks: Sequence[str]) -> list[Endpoint]:
    """The hooks' endpoints; one that cannot be parsed is left out with a warning that says why (a replica left
    without any is blind: the core's rules)."""
    found = []
    for hook in hooks:
        try:
            found.append(parse_url(hook, "routing stats memtel_hooks"))
        except ConfigError as exc:
            log.warning("memtel: %s; that hook is not read", exc)
    return found


__all__ = ["TOKENIZE_TIMEOUT_S", "Fleet", "Member", "RouterSettings"]
