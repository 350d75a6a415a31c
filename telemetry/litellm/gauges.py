"""Each deployment's hook gauges, read the way `memtel guard` reads them, and the deployment with the most room.

A deployment names its ranks' hook exporters in its `model_info` (`memtel_hooks: [URL, ...]`): LiteLLM keeps
`model_info` as given and hands it to callbacks with the deployment, while an unknown key of `litellm_params`
would be sent on to the provider. Each distinct set of hooks gets one `LimitTracker`, scraped every poll on the
proxy's event loop from the first request that needs it; the first request waits (at most the scrape timeout)
for the first answers instead of passing blind.

Each hook is scraped by a task of its own (`scrape`), so one slow hook never holds back the others' readings:
its whole answer within MEMTEL_LITELLM_TIMEOUT_S, read at most MAX_HOOK_BYTES far, with httpx (the guard's h11
client needs an `asyncio.Transport`, and LiteLLM's proxy runs on uvloop), parsed by the guard's parser in a worker
thread, where the core's `parse_hook` leaves out any rank past what a node can have (tokens over 2^31, bytes over
16 TiB), before the guard's `LimitTracker` sees it. The loop is supervised: a failure is logged once per kind,
counted, and the scrapes go on.

The pool: a deployment whose hook or engine refuses a connection leaves it (`GaugeBook.leave`) and the gate
decides again without it, until its hooks answer again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from telemetry.admission.core import SETTING_RANGES
from telemetry.admission.readings import HookReading, Limit, RankFit, parse_hook
from telemetry.errors import ConfigError, printable, shown
from telemetry.guard.limit import MAX_METRICS_BYTES, LimitTracker
from telemetry.url import Endpoint, parse_url

HOOKS_KEY = "memtel_hooks"
log = logging.getLogger("memtel.litellm")
PIN_KEY = "memtel_deployment"  # the request's metadata: the deployment the pre-call hook admitted it to
ENV = {"hold_s": "MEMTEL_LITELLM_HOLD_S", "stale_s": "MEMTEL_LITELLM_STALE_S",
       "reserve_mb": "MEMTEL_LITELLM_RESERVE_MB", "timeout_s": "MEMTEL_LITELLM_TIMEOUT_S"}
# Each setting's range [floor, ceiling]: every front door's (the admission core's SETTING_RANGES).
RANGES = {"hold_s": SETTING_RANGES["queue_s"], "stale_s": SETTING_RANGES["stale_s"],
          "reserve_mb": SETTING_RANGES["reserve_mb"], "timeout_s": SETTING_RANGES["timeout_s"]}
UNITS = {"hold_s": "seconds", "stale_s": "seconds", "reserve_mb": "MiB", "timeout_s": "seconds"}
MAX_HOOK_BYTES = MAX_METRICS_BYTES


@dataclass(frozen=True)
class GateSettings:
    hold_s: float = 10.0  # how long a prompt that does not fit now waits for the limit to rise
    stale_s: float = 15.0  # as `memtel guard --stale-s`
    reserve_mb: float = 0.0  # as `memtel guard --reserve-mb`
    timeout_s: float = 2.0  # one scrape of a hook (its whole answer), one /v1/models of an upstream

    @property
    def poll_s(self) -> float:
        return min(1.0, self.stale_s / 3)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GateSettings:
        """The settings from MEMTEL_LITELLM_* (ConfigError, one line, for a value outside its range)."""
        env = os.environ if env is None else env
        values: dict[str, float] = {}
        for name, variable in ENV.items():
            text = env.get(variable)
            if text is None:
                continue
            try:
                value = float(text)
            except ValueError:
                value = float("nan")
            low, high = RANGES[name]
            if not low <= value <= high:  # NaN fails both
                raise ConfigError(f"{variable}={shown(text)}: expected a number of {UNITS[name]} from {low:g} to "
                                  f"{high:g} (default {getattr(cls, name):g})")
            values[name] = value
        return cls(**values)


def deployment_hooks(deployment: Mapping[str, Any]) -> tuple[Endpoint, ...]:
    """The hooks a deployment names in `model_info.memtel_hooks` (a list of URLs or one comma-separated string)."""
    raw = (deployment.get("model_info") or {}).get(HOOKS_KEY)
    if raw is None:
        return ()
    items = raw.split(",") if isinstance(raw, str) else raw
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise ConfigError(f"model_info.{HOOKS_KEY}: expected a list of hook URLs, got {type(raw).__name__}")
    return tuple(parse_url(item, f"model_info.{HOOKS_KEY}") for item in items if item.strip())


def deployment_id(deployment: Mapping[str, Any]) -> str | None:
    found = (deployment.get("model_info") or {}).get("id")
    return str(found) if found is not None else None


def upstream_root(deployment: Mapping[str, Any]) -> str | None:
    """The engine's base URL (its `api_base` without `/v1`), where /tokenize and /v1/models are."""
    base = (deployment.get("litellm_params") or {}).get("api_base")
    if not isinstance(base, str) or not base:
        return None
    base = base.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


@dataclass(frozen=True)
class Room:
    """One deployment and the limit in force on it now (None: blind); `left`: why it is out of the pool."""

    deployment: dict[str, Any]
    tracker: LimitTracker
    limit: Limit | None
    left: str | None = None


def roomiest(rooms: Sequence[Room], tokens: int | None = None) -> Room | None:
    """The deployment in the pool that can take the most now, if `tokens` (when given) fit it; None where none
    is seen or fits.

    The most room left after a prompt is the largest limit, whatever the prompt; a prompt that does not fit the
    largest fits none, so the guard's decision against that one deployment is the decision for the group.
    """
    best = max((r for r in rooms if r.limit is not None and r.left is None),
               key=lambda r: r.limit.tokens if r.limit else 0, default=None)
    if best is None or best.limit is None or (tokens is not None and tokens > best.limit.tokens):
        return None
    return best


def read_hook(body: bytes) -> tuple[list[RankFit], list[str]]:
    """A hook's answer, parsed and bounded by the core's parser (in a worker thread: it can be megabytes)."""
    return parse_hook(body.decode("utf-8", "replace"))


class GaugeBook:
    """One LimitTracker per set of hooks, each hook scraped by its own task on the running loop; which trackers'
    deployments refused a connection, until they answer again (the gate mirrors it into the core's pool)."""

    def __init__(self, settings: GateSettings) -> None:
        self.settings = settings
        self._trackers: dict[tuple[str, ...], LimitTracker] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._left: dict[int, tuple[float, str]] = {}  # id(tracker): (monotonic time it left, why)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.loop_failures = 0  # a scrape loop's failures that were not a hook's (logged once each kind)
        self._logged: set[str] = set()

    def _for_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # scrapes live on one loop (the proxy has one; tests may start several)
            self.close()
            self._loop = loop

    def tracker(self, hooks: tuple[Endpoint, ...]) -> tuple[LimitTracker, bool]:
        """The hooks' tracker, and whether it is new (its first scrape has not been awaited)."""
        self._for_loop()
        key = tuple(h.url for h in hooks)
        found = self._trackers.get(key)
        if found is not None:
            return found, False
        found = LimitTracker(list(hooks), stale_s=self.settings.stale_s,
                             reserve_bytes=self.settings.reserve_mb * (1 << 20))
        self._trackers[key] = found
        loop = asyncio.get_running_loop()
        self._tasks.extend(loop.create_task(self._scrape_forever(found, hook)) for hook in found.hooks)
        return found, True

    async def rooms(self, deployments: Sequence[dict[str, Any]]) -> list[Room]:
        """The deployments that name hooks, each with its limit now and whether it is out of the pool."""
        found = []
        for deployment in deployments:
            hooks = deployment_hooks(deployment)
            if hooks:
                found.append((deployment, self.tracker(hooks)[0]))
        pending = [t for _d, t in found if any(h.scraped_at is None and h.error is None for h in t.hooks)]
        if pending:  # every request that comes before a hook's first answer waits for it, not only the first
            await _first_answers(pending, self.settings.timeout_s)
        return [Room(deployment, tracker, tracker.limit(), self.left(tracker)) for deployment, tracker in found]

    def leave(self, tracker: LimitTracker, reason: str) -> None:
        """The deployment of `tracker` refused a connection: out of the pool until every hook has answered again
        and `stale_s` has passed (a restarted engine, or one that was only slow to accept)."""
        if id(tracker) not in self._left:
            log.warning("memtel: a deployment leaves the pool: %s", printable(reason, 300))
        self._left[id(tracker)] = (time.monotonic(), reason)

    def left(self, tracker: LimitTracker) -> str | None:
        """Why `tracker`'s deployment is out of the pool, or None while it is in it."""
        found = self._left.get(id(tracker))
        if found is None:
            return None
        at, reason = found
        if time.monotonic() - at >= self.settings.stale_s and all(
                h.scraped_at is not None and h.scraped_at > at for h in tracker.hooks):
            del self._left[id(tracker)]
            log.warning("memtel: a deployment is back in the pool (%s)", ", ".join(h.target.url for h in tracker.hooks))
            return None
        return reason

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        self._trackers.clear()
        self._left.clear()

    async def _scrape_forever(self, tracker: LimitTracker, hook: HookReading) -> None:
        """Scrape one hook every poll, on its own: a slow hook costs only its own reading. Supervised: a failure
        that is not the hook's is logged once per kind, counted, and the loop goes on."""
        poll_s = self.settings.poll_s
        async with httpx.AsyncClient(trust_env=False) as client:
            while True:
                started = time.monotonic()
                await self._scrape_once(tracker, hook, client)
                await asyncio.sleep(max(0.0, poll_s - (time.monotonic() - started)))

    async def _scrape_once(self, tracker: LimitTracker, hook: HookReading, client: httpx.AsyncClient) -> None:
        try:
            if await scrape(tracker, hook, self.settings.timeout_s, client):
                self.leave(tracker, f"its hook {hook.target.url} refused the connection")
            tracker.limit()  # a blind episode starts and ends with the hooks (the tracker logs it)
        except Exception as exc:  # never the end of the scrapes: the gate would go on with a stale limit
            self.loop_failures += 1
            kind = type(exc).__name__
            if kind not in self._logged:
                self._logged.add(kind)
                log.error("memtel: a hook scrape failed (%s: %s); scrapes go on", kind, printable(str(exc), 200))
            tracker.record(hook, None, f"{kind}: {exc}"[:200])


async def scrape(tracker: LimitTracker, hook: HookReading, timeout_s: float,
                 client: httpx.AsyncClient | None = None) -> bool:
    """One scrape of one hook, recorded in the tracker as `memtel guard` records it: the whole answer within
    `timeout_s`, at most MAX_HOOK_BYTES read (a longer one is dropped unread). True: the hook refused the
    connection."""
    target = hook.target
    headers = {"Connection": "close"}  # as the guard's scrape: a hook that is gone refuses the next one
    if target.authorization:
        headers["Authorization"] = target.authorization

    async def read(session: httpx.AsyncClient) -> bytes:
        async with session.stream("GET", target.url, headers=headers) as answer:
            if answer.status_code != 200:
                raise ValueError(f"answered HTTP {answer.status_code}")
            chunks, size = [], 0
            async for chunk in answer.aiter_bytes():
                size += len(chunk)
                if size > MAX_HOOK_BYTES:
                    raise ValueError(f"answered more than {MAX_HOOK_BYTES} bytes")
                chunks.append(chunk)
            return b"".join(chunks)

    try:
        async with contextlib.AsyncExitStack() as stack:
            session = client if client is not None else await stack.enter_async_context(
                httpx.AsyncClient(trust_env=False))
            body = await asyncio.wait_for(read(session), timeout_s)
        fits, rejected = await asyncio.to_thread(read_hook, body)
    except httpx.ConnectError as exc:
        tracker.record(hook, None, f"{type(exc).__name__}: {exc}"[:200])
        return True
    except (httpx.HTTPError, ValueError, asyncio.TimeoutError) as exc:
        tracker.record(hook, None, f"{type(exc).__name__}: {str(exc) or 'no whole answer in time'}"[:200])
    else:
        tracker.record(hook, fits, None, rejected)
    return False


async def _first_answers(trackers: list[LimitTracker], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s + 0.5
    while time.monotonic() < deadline and any(h.scraped_at is None and h.error is None
                                              for t in trackers for h in t.hooks):
        await asyncio.sleep(0.01)


__all__ = ["ENV", "HOOKS_KEY", "PIN_KEY", "RANGES", "GateSettings", "GaugeBook",
           "Room", "deployment_hooks", "deployment_id", "read_hook", "roomiest", "scrape", "upstream_root"]
