"""The limit in force: the longest prefill the ranks can take now, less what admitted prefills will take.

Each hook exporter (`--hooks`) is scraped every `poll_s`. From its /metrics the guard reads, per
`rank` and `node`, `memtel_forecast_max_prefill_tokens` (the longest cold prefill that fits the memory
the rank may still take), `memtel_forecast_fit_budget_bytes` (that memory),
`memtel_forecast_last_success_timestamp_seconds` (when the forecast's snapshot was taken),
`memtel_forecast_reserved_growth_bytes{tokens}` (the bytes forecast for fixed lengths, quoted in a
refusal) and `memtel_forecast_max_prefill_tokens_at_best` (what the rank could take with an empty cache:
the permanent limit, kept as at_best.py says). A rank is fresh while its hook answered within `stale_s`
and its forecast is younger than `stale_s`. The limit is the smallest fresh rank's tokens (cut by
`reserve_bytes`, see `RankFit.tokens`), less the tokens of admitted requests still in their prefill
(`hold`/`release`). No fresh rank: blind.

A hook is not trusted further than its gauges make sense: a rank whose tokens or budget is NaN, infinite
or negative, or whose forecast time is missing, not a positive finite number, or in the future, is not
fresh, and `why_blind` says why. An answer is read through h11 (at most `MAX_METRICS_BYTES`) and parsed in
a worker thread, so a large one does not stall the event loop that serves the clients.
"""

from __future__ import annotations

import asyncio
import logging
import math
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from telemetry.catalogue import metrics as catalogue
from telemetry.guard.at_best import AT_BEST_WINDOW_S, AtBest, AtBestBook, replica_at_best
from telemetry.guard.http import ClientSide, UpstreamError, open_channel
from telemetry.scrape import parse
from telemetry.url import Endpoint

log = logging.getLogger("memtel.guard")

MAX_PREFILL = catalogue.FORECAST_MAX_PREFILL_TOKENS.series
FIT_BUDGET = catalogue.FORECAST_FIT_BUDGET.series
LAST_SUCCESS = catalogue.FORECAST_LAST_SUCCESS.series
GROWTH = catalogue.FORECAST_RESERVED_GROWTH.series
AT_BEST = catalogue.FORECAST_MAX_PREFILL_TOKENS_AT_BEST.series
_WANTED = (catalogue.FORECAST_MAX_PREFILL_TOKENS, catalogue.FORECAST_FIT_BUDGET, catalogue.FORECAST_LAST_SUCCESS,
           catalogue.FORECAST_RESERVED_GROWTH, catalogue.FORECAST_MAX_PREFILL_TOKENS_AT_BEST)
MAX_METRICS_BYTES = 4 << 20  # a hook's /metrics is tens of kB; a larger answer is not a hook's
MAX_HEAD_BYTES = 16384
# How far ahead of the guard's clock a forecast's timestamp may be (the hooks' nodes' clocks, NTP-synced,
# differ by milliseconds); further ahead, the timestamp is wrong and would never age.
FUTURE_SLACK_S = 2.0


@dataclass(frozen=True)
class RankFit:
    """One rank's forecast as its hook exported it."""

    rank: str
    node: str
    max_prefill_tokens: int
    budget_bytes: float | None
    forecast_time: float | None  # unix time of the forecast's snapshot
    growth_bytes: tuple[tuple[int, float], ...] = ()  # (tokens, forecast reserved growth), ascending
    at_best_tokens: int | None = None  # the longest prefill with an empty cache (None: a hook without the gauge)

    def tokens(self, reserve_bytes: float) -> int:
        """The rank's limit with `reserve_bytes` more kept free: its tokens scaled by the budget left.

        Linear scaling is conservative where a prefill's bytes grow at least linearly with its length from
        zero (the indexer's logits do); docs/guard.md says so.
        """
        if reserve_bytes <= 0 or not self.budget_bytes:
            return self.max_prefill_tokens
        left = max(0.0, self.budget_bytes - reserve_bytes)
        return math.floor(self.max_prefill_tokens * left / self.budget_bytes)

    def forecast_for(self, tokens: int) -> tuple[int, float] | None:
        """The hook's forecast for the shortest forecast length >= `tokens`, if it forecasts one."""
        return next(((t, b) for t, b in self.growth_bytes if t >= tokens), None)


    def stale_reason(self, wall: float, stale_s: float) -> str | None:
        """Why this forecast is not used at unix time `wall`, or None while it is fresh."""
        at = self.forecast_time
        if at is None:
            return f"rank {self.rank} on node {self.node} exports no {LAST_SUCCESS}"
        if at > wall + FUTURE_SLACK_S:
            return f"rank {self.rank} on node {self.node}: forecast time {at - wall:.3g} s in the future"
        if wall - at > stale_s:
            return f"forecast older than {stale_s:g} s"
        return None


def parse_fits(text: str) -> list[RankFit]:
    """The ranks' usable forecasts in a hook's exposition text (`parse_hook` without the rejections)."""
    return parse_hook(text)[0]


def _bad(value: float | None, *, positive: bool = False) -> bool:
    return value is not None and (not math.isfinite(value) or value < 0 or (positive and value == 0))


def parse_hook(text: str) -> tuple[list[RankFit], list[str]]:
    """The ranks' forecasts in a hook's exposition text (only the wanted series are parsed), and why each rank
    that exports nonsense (a NaN, infinite or negative gauge or forecast time) is left out."""
    values: dict[tuple[str, str], dict[str, float]] = {}
    growth: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for sample in parse(text, only=_WANTED).samples:   # the other lines are not parsed
        key = (sample.labels.get("rank", ""), sample.labels.get("node", ""))
        if sample.name == GROWTH:
            length = sample.labels.get("tokens", "")
            if length.isdigit() and len(length) <= 18 and math.isfinite(sample.value) and sample.value >= 0:
                growth.setdefault(key, []).append((int(length), sample.value))
        elif sample.name in (MAX_PREFILL, FIT_BUDGET, LAST_SUCCESS, AT_BEST):
            values.setdefault(key, {})[sample.name] = sample.value
    fits, rejected = [], []
    for (rank, node), found in values.items():
        tokens, budget, at = found.get(MAX_PREFILL), found.get(FIT_BUDGET), found.get(LAST_SUCCESS)
        at_best = found.get(AT_BEST)
        if tokens is None:
            continue
        bad = [f"{name} is {value:g}" for name, value, positive in ((MAX_PREFILL, tokens, False),
                                                                   (FIT_BUDGET, budget, False),
                                                                   (LAST_SUCCESS, at, True),
                                                                   (AT_BEST, at_best, False))
               if _bad(value, positive=positive)]
        if bad:
            rejected.append(f"rank {rank} on node {node}: {', '.join(bad)}")
            continue
        fits.append(RankFit(rank, node, int(tokens), budget, at, tuple(sorted(growth.get((rank, node), []))),
                            None if at_best is None else int(at_best)))
    return fits, rejected


@dataclass
class HookState:
    target: Endpoint  # the hook's exporter (`--hooks`: telemetry/url.py parses it)
    fits: list[RankFit] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)  # ranks whose gauges make no sense, and why
    scraped_at: float | None = None  # monotonic time of the last successful scrape
    error: str | None = None  # why the last scrape failed
    failures: int = 0


@dataclass(frozen=True)
class Limit:
    """The limit in force at one moment, and what set it."""

    tokens: int  # what a prompt may hold now: the rank's limit less the tokens in prefill
    rank_tokens: int  # the limiting rank's longest fitting prefill (after --reserve-mb)
    in_prefill_tokens: int
    fit: RankFit
    hook: str


class LimitTracker:
    """The hooks' last answers, the tokens held by admitted prefills, and the blind episodes."""

    def __init__(self, targets: list[Endpoint], *, stale_s: float, reserve_bytes: float = 0.0,
                 at_best_window_s: float = AT_BEST_WINDOW_S) -> None:
        self.hooks = [HookState(t) for t in targets]
        self.book = AtBestBook(at_best_window_s)  # clean at-best readings, prefills in flight (at_best.py)
        self.stale_s = stale_s
        self.reserve_bytes = reserve_bytes
        self.in_prefill_tokens = 0
        self.blind: bool | None = None  # None until the first decision
        self.blind_seconds = 0.0
        self.blind_episodes = 0
        self._blind_since: float | None = None
        # What the last `limit()` found, for the metrics (read on the exporter's threads, written on the loop's).
        self.published: Limit | None = None
        self.published_fresh = 0
        self.published_at_best: AtBest | None = None  # `at_best()` after each round of scrapes
        # Called on the loop whenever the limit may have changed (a hook's scrape, a hold released): the guard's
        # queue wakes its waiters from here instead of polling (telemetry/guard/queue.py).
        self._listeners: list[Callable[[], None]] = []

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call `listener()` (on the event loop, without arguments) whenever the limit may have risen."""
        self._listeners.append(listener)

    def notify(self) -> None:
        for listener in self._listeners:
            listener()

    # -- the hooks' answers ------------------------------------------------------------------------
    def record(self, hook: HookState, fits: list[RankFit] | None, error: str | None,
               rejected: list[str] | None = None) -> None:
        if fits is not None:
            hook.fits, hook.scraped_at, hook.error = fits, time.monotonic(), None
            hook.rejected = rejected or []
            self.book.observe(hook.target.url, fits)
            self.notify()  # a new limit
        else:
            hook.error = error
            hook.failures += 1
            if hook.scraped_at is None or time.monotonic() - hook.scraped_at > self.stale_s:
                self.notify()  # its forecast is stale now: maybe blind (--when-blind admit then admits the waiters)

    def fresh(self) -> list[tuple[HookState, RankFit]]:
        now, wall = time.monotonic(), time.time()
        found: list[tuple[HookState, RankFit]] = []
        for hook in self.hooks:
            if hook.scraped_at is None or now - hook.scraped_at > self.stale_s:
                continue
            found.extend((hook, fit) for fit in hook.fits if fit.stale_reason(wall, self.stale_s) is None)
        return found

    def why_blind(self) -> str:
        parts = []
        for hook in self.hooks:
            # The last scrape's failure first: its last forecast also ages out while it fails, and the failure is
            # the cause (the forecast can age past stale_s a scrape's latency before the answer does).
            if hook.error is not None or hook.scraped_at is None or time.monotonic() - hook.scraped_at > self.stale_s:
                parts.append(f"{hook.target.url}: {hook.error or 'no answer yet'}")
            elif not hook.fits and not hook.rejected:
                parts.append(f"{hook.target.url}: exports no {MAX_PREFILL}")
            else:
                wall = time.time()
                reasons = [*hook.rejected, *(r for f in hook.fits if (r := f.stale_reason(wall, self.stale_s)))]
                parts.append(f"{hook.target.url}: {'; '.join(dict.fromkeys(reasons)) or 'fresh'}")
        return "; ".join(parts)

    # -- the limit ----------------------------------------------------------------------------------
    def limit(self) -> Limit | None:
        """The limit in force now, or None when blind (also tracks the blind episodes)."""
        fresh = self.fresh()
        self._set_blind(not fresh)
        self.published_fresh = len(fresh)
        if not fresh:
            self.published = None
            return None
        hook, fit = min(fresh, key=lambda hf: hf[1].tokens(self.reserve_bytes))
        rank_tokens = fit.tokens(self.reserve_bytes)
        self.published = Limit(max(0, rank_tokens - self.in_prefill_tokens), rank_tokens, self.in_prefill_tokens,
                               fit, hook.target.url)
        return self.published

    def at_best(self) -> AtBest | None:
        """The most this replica could take with its caches empty, where it can be trusted (at_best.py)."""
        return replica_at_best(self)[0]

    def hold(self, tokens: int) -> None:
        """An admitted request's prefill starts (every admission, 0 tokens for one admitted blind)."""
        self.in_prefill_tokens += tokens
        self.book.started()

    def release(self, tokens: int) -> None:
        """Its prefill is over: once for each `hold`."""
        self.in_prefill_tokens = max(0, self.in_prefill_tokens - tokens)
        self.book.ended()
        self.notify()

    def _set_blind(self, blind: bool) -> None:
        now = time.monotonic()
        if blind and not self.blind:
            self.blind_episodes += 1
            self._blind_since = now
            log.warning("memtel guard is blind: no fresh hook (%s); requests are decided by --when-blind",
                        self.why_blind())
        elif not blind and self.blind:
            self._account(now)
            self._blind_since = None
            log.warning("memtel guard sees again: a fresh limit from the hooks")
        elif blind:
            self._account(now)
        self.blind = blind

    def blind_seconds_now(self, now: float) -> float:
        since = self._blind_since
        return self.blind_seconds + (now - since if self.blind and since is not None else 0.0)

    def _account(self, now: float) -> None:
        if self._blind_since is not None:
            self.blind_seconds += now - self._blind_since
            self._blind_since = now


async def fetch_metrics(target: Endpoint, timeout_s: float) -> bytes:
    """One GET of a hook's /metrics, its body (at most MAX_METRICS_BYTES), all within `timeout_s`;
    OSError / TimeoutError / UpstreamError on failure."""
    async def get() -> bytes:
        context = ssl.create_default_context() if target.tls else None
        side = ClientSide(await open_channel(target.host, target.port, context, timeout_s), MAX_HEAD_BYTES)
        try:
            headers = [("Host", target.host_port), ("Accept", "text/plain"), ("Connection", "close")]
            if target.authorization:
                headers.append(("Authorization", target.authorization))
            await side.send_request("GET", target.path, headers, b"", timeout_s)
            response = await side.response()
            if response.status != 200:
                raise UpstreamError(f"answered HTTP {response.status}")
            return await side.read_all(MAX_METRICS_BYTES)
        finally:
            side.channel.close()

    return await asyncio.wait_for(get(), timeout_s)


def _read_hook(body: bytes) -> tuple[list[RankFit], list[str]]:
    return parse_hook(body.decode("utf-8", "replace"))


async def scrape_forever(tracker: LimitTracker, poll_s: float, timeout_s: float) -> None:
    """Scrape every hook every `poll_s` (all at once), record the answers, keep the blind state current."""
    async def one(hook: HookState) -> None:
        try:
            body = await fetch_metrics(hook.target, timeout_s)
            fits, rejected = await asyncio.to_thread(_read_hook, body)  # not on the loop that serves the clients
        except (OSError, asyncio.TimeoutError, UpstreamError, ValueError) as exc:
            tracker.record(hook, None, f"{type(exc).__name__}: {exc}"[:200])
        else:
            tracker.record(hook, fits, None, rejected)

    while True:
        started = time.monotonic()
        await asyncio.gather(*(one(h) for h in tracker.hooks))
        tracker.limit()  # a blind episode starts and ends with the hooks, not with the next request
        tracker.published_at_best = tracker.at_best()
        await asyncio.sleep(max(0.0, poll_s - (time.monotonic() - started)))


__all__ = ["AT_BEST", "FIT_BUDGET", "GROWTH", "LAST_SUCCESS", "MAX_PREFILL", "HookState", "Limit", "LimitTracker",
           "RankFit", "fetch_metrics", "parse_fits", "parse_hook", "scrape_forever"]
