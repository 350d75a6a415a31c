"""Each deployment's hook gauges, read the way `memtel guard` reads them, and the deployment with the most room.

A deployment names its ranks' hook exporters in its `model_info` (`memtel_hooks: [URL, ...]`): LiteLLM keeps
`model_info` as given and hands it to callbacks with the deployment, while an unknown key of `litellm_params`
would be sent on to the provider. Each distinct set of hooks gets one `LimitTracker`, scraped every poll on the
proxy's event loop from the first request that needs it; the first request waits (at most the scrape timeout)
for the first answers instead of passing blind.

The scrape (`scrape_loop`) reads each hook's answer with httpx and hands it to the guard's own parser and
tracker (`parse_hook`, `LimitTracker.record`): the guard's h11 client (`fetch_metrics`) needs an
`asyncio.Transport`, and LiteLLM's proxy always runs on uvloop, whose transports are not one.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from telemetry.errors import ConfigError, shown
from telemetry.guard.limit import MAX_METRICS_BYTES, HookState, Limit, LimitTracker, parse_hook
from telemetry.guard.refusal import ContextLength
from telemetry.url import Endpoint, parse_url

HOOKS_KEY = "memtel_hooks"
PIN_KEY = "memtel_deployment"  # the request's metadata: the deployment the pre-call hook admitted it to
ENV = {"hold_s": "MEMTEL_LITELLM_HOLD_S", "stale_s": "MEMTEL_LITELLM_STALE_S",
       "reserve_mb": "MEMTEL_LITELLM_RESERVE_MB", "timeout_s": "MEMTEL_LITELLM_TIMEOUT_S"}
EXPECTED = {"hold_s": "seconds >= 0", "stale_s": "seconds > 0", "reserve_mb": "MiB >= 0", "timeout_s": "seconds > 0"}


@dataclass(frozen=True)
class GateSettings:
    hold_s: float = 10.0  # how long a prompt that does not fit now waits for the limit to rise
    stale_s: float = 15.0  # as `memtel guard --stale-s`
    reserve_mb: float = 0.0  # as `memtel guard --reserve-mb`
    timeout_s: float = 2.0  # one scrape of a hook, one /tokenize or /v1/models of an upstream

    @property
    def poll_s(self) -> float:
        return min(1.0, self.stale_s / 3)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GateSettings:
        """The settings from MEMTEL_LITELLM_* (ConfigError, one line, for a value that is not a number >= 0)."""
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
            if not value >= 0 or value == float("inf") or (name in ("stale_s", "timeout_s") and value == 0):
                raise ConfigError(f"{variable}={shown(text)}: expected a finite number of {EXPECTED[name]} "
                                  f"(default {getattr(cls, name):g})")
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
    """One deployment and the limit in force on it now (None: blind)."""

    deployment: dict[str, Any]
    tracker: LimitTracker
    limit: Limit | None


def roomiest(rooms: Sequence[Room], tokens: int | None = None) -> Room | None:
    """The deployment that can take the most now, if `tokens` (when given) fit it; None where none is seen or fits.

    The most room left after a prompt is the largest limit, whatever the prompt; a prompt that does not fit the
    largest fits none, so the guard's decision against that one deployment is the decision for the group.
    """
    best = max((r for r in rooms if r.limit is not None), key=lambda r: r.limit.tokens if r.limit else 0, default=None)
    if best is None or best.limit is None or (tokens is not None and tokens > best.limit.tokens):
        return None
    return best


class GaugeBook:
    """One LimitTracker per set of hooks, scraped on the running loop; max-model-len per upstream."""

    def __init__(self, settings: GateSettings) -> None:
        self.settings = settings
        self._trackers: dict[tuple[str, ...], LimitTracker] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._contexts: dict[str, ContextLength] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

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
        self._tasks.append(asyncio.get_running_loop().create_task(
            scrape_loop(found, self.settings.poll_s, self.settings.timeout_s)))
        return found, True

    async def rooms(self, deployments: Sequence[dict[str, Any]]) -> list[Room]:
        """The deployments that name hooks, each with its limit now."""
        found, new = [], []
        for deployment in deployments:
            hooks = deployment_hooks(deployment)
            if hooks:
                tracker, fresh_tracker = self.tracker(hooks)
                found.append((deployment, tracker))
                if fresh_tracker:
                    new.append(tracker)
        if new:
            await _first_answers(new, self.settings.timeout_s)
        return [Room(deployment, tracker, tracker.limit()) for deployment, tracker in found]

    def context(self, root: str) -> ContextLength:
        return self._contexts.setdefault(root, ContextLength())

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        self._trackers.clear()


async def scrape(client: httpx.AsyncClient, tracker: LimitTracker, hook: HookState) -> None:
    """One scrape of one hook, recorded in the tracker as `memtel guard` records it."""
    target = hook.target
    headers = {"Authorization": target.authorization} if target.authorization else {}
    try:
        answer = await client.get(target.url, headers=headers)
        if answer.status_code != 200:
            raise ValueError(f"answered HTTP {answer.status_code}")
        if len(answer.content) > MAX_METRICS_BYTES:
            raise ValueError(f"answered more than {MAX_METRICS_BYTES} bytes")
        fits, rejected = await asyncio.to_thread(parse_hook, answer.content.decode("utf-8", "replace"))
    except (httpx.HTTPError, ValueError) as exc:
        tracker.record(hook, None, f"{type(exc).__name__}: {exc}"[:200])
    else:
        tracker.record(hook, fits, None, rejected)


async def scrape_loop(tracker: LimitTracker, poll_s: float, timeout_s: float) -> None:
    """Scrape every hook of `tracker` every `poll_s` (all at once), as the guard's `scrape_forever` does."""
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
        while True:
            started = time.monotonic()
            await asyncio.gather(*(scrape(client, tracker, h) for h in tracker.hooks))
            tracker.limit()
            await asyncio.sleep(max(0.0, poll_s - (time.monotonic() - started)))


async def _first_answers(trackers: list[LimitTracker], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s + 0.5
    while time.monotonic() < deadline and any(h.scraped_at is None and h.error is None
                                              for t in trackers for h in t.hooks):
        await asyncio.sleep(0.01)


__all__ = ["ENV", "HOOKS_KEY", "PIN_KEY", "GateSettings", "GaugeBook", "Room", "deployment_hooks", "deployment_id",
           "roomiest", "scrape", "scrape_loop", "upstream_root"]
