"""The guard's side of the readings: the hooks scraped every `poll_s`, their answers recorded in the admission
core's `Readings` (telemetry/admission/readings.py says what is read and when a rank is fresh).

`LimitTracker` is those readings with the clocks read here, the blind episodes logged, and listeners woken (the
guard's queue) whenever the limit may have risen. A hook's answer is read through h11 (at most `MAX_METRICS_BYTES`)
and parsed in a worker thread, so a large one does not stall the event loop that serves the clients.

The scrapes are supervised (`scrape_forever`): a failure that is not the hook's own (an error in the readings'
arithmetic, say) is logged once per kind, counted as that hook's failed scrape, and its forecast forgotten, so the
guard is blind for it (and says so in /metrics and /health) rather than going on with a limit it no longer reads;
the scrapes go on.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable

from telemetry.admission.at_best import AT_BEST_WINDOW_S, AtBest
from telemetry.admission.readings import (
    AT_BEST,
    FIT_BUDGET,
    FUTURE_SLACK_S,
    GROWTH,
    LAST_SUCCESS,
    MAX_PREFILL,
    NO_GAUGE_HINT,
    HookReading,
    Limit,
    RankFit,
    Readings,
    parse_fits,
    parse_hook,
    replica_at_best,
)
from telemetry.errors import printable
from telemetry.guard.http import ClientSide, UpstreamError, open_channel
from telemetry.url import Endpoint

log = logging.getLogger("memtel.guard")

MAX_METRICS_BYTES = 4 << 20  # a hook's /metrics is tens of kB; a larger answer is not a hook's
MAX_HEAD_BYTES = 16384


class LimitTracker(Readings):
    """One replica's readings (admission core), the clocks read here; the blind episodes logged."""

    def __init__(self, targets: list[Endpoint], *, stale_s: float, reserve_bytes: float = 0.0,
                 at_best_window_s: float = AT_BEST_WINDOW_S) -> None:
        super().__init__(targets, stale_s=stale_s, reserve_bytes=reserve_bytes, at_best_window_s=at_best_window_s)
        # What the last `limit()` found, for the metrics (read on the exporter's threads, written on the loop's).
        self.published: Limit | None = None
        self.published_fresh = 0
        self.published_at_best: AtBest | None = None  # `at_best()` after each round of scrapes
        self.warned_without_gauge: set[str] = set()  # hooks already logged as answering without the gauge
        self.logged_failures: set[str] = set()  # kinds of scrape failure not the hook's, each logged once
        # Called on the loop whenever the limit may have changed (a hook's scrape, a hold released): the guard's
        # queue wakes its waiters from here instead of polling.
        self._listeners: list[Callable[[], None]] = []

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call `listener()` (on the event loop, without arguments) whenever the limit may have risen."""
        self._listeners.append(listener)

    def notify(self) -> None:
        for listener in self._listeners:
            listener()

    def record(self, hook: HookReading, fits: list[RankFit] | None, error: str | None,
               rejected: list[str] | None = None) -> None:
        if self.record_at(hook, fits, error, rejected, time.monotonic(), time.time()):
            self.notify()  # a new limit, or the last one stale: maybe blind (--when-blind admit admits the waiters)
        if hook.without_gauge() and hook.target.url not in self.warned_without_gauge:
            self.warned_without_gauge.add(hook.target.url)
            log.error("memtel guard: the hook %s answers but exports no %s: %s; until it does, the guard is blind "
                      "for its ranks and --when-blind decides", hook.target.url, MAX_PREFILL, NO_GAUGE_HINT)

    def failed(self, hook: HookReading, exc: Exception) -> None:
        """A scrape of `hook` failed in the guard's own work on its answer: its forecast is forgotten (blind for
        its ranks, not a limit no longer read), the failure counted as the hook's and logged once per kind."""
        kind = type(exc).__name__
        hook.fits, hook.rejected = [], []
        self.record(hook, None, printable(f"{kind}: {exc}", 200))
        if kind not in self.logged_failures:
            self.logged_failures.add(kind)
            log.error("memtel guard: reading the hook %s failed (%s); its forecast is not used until it answers "
                      "again, and the scrapes go on", hook.target.url, printable(f"{kind}: {exc}", 200))

    def fresh(self, now: float | None = None, wall: float | None = None) -> list[tuple[HookReading, RankFit]]:
        return super().fresh(time.monotonic() if now is None else now, time.time() if wall is None else wall)

    def why_blind(self) -> str:
        return self.why_blind_at(time.monotonic(), time.time())

    def limit(self) -> Limit | None:
        """The limit in force now, or None when blind (also tracks the blind episodes, for the metrics)."""
        now, wall = time.monotonic(), time.time()
        found = self.limit_at(now, wall)
        self.published_fresh = len(self.fresh(now, wall))
        self.published = found
        change = self.note_blind(found is None, now)
        if change == "blind":
            log.warning("memtel guard is blind: no fresh hook (%s); requests are decided by --when-blind",
                        self.why_blind_at(now, wall))
        elif change == "sees":
            log.warning("memtel guard sees again: a fresh limit from the hooks")
        return found

    def at_best(self) -> AtBest | None:
        """The most this replica could take with its caches empty, where it can be trusted (at_best.py)."""
        return replica_at_best(self, time.monotonic(), time.time())[0]

    def hold(self, tokens: int) -> None:
        """An admitted request's prefill starts (every admission, 0 tokens for one admitted blind)."""
        self.hold_at(tokens, time.time())

    def release(self, tokens: int) -> None:
        """Its prefill is over: once for each `hold`."""
        self.release_at(tokens, time.time())
        self.notify()


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
    async def one(hook: HookReading) -> None:
        try:
            body = await fetch_metrics(hook.target, timeout_s)
            fits, rejected = await asyncio.to_thread(_read_hook, body)  # not on the loop that serves the clients
        except (OSError, asyncio.TimeoutError, UpstreamError, ValueError) as exc:
            tracker.record(hook, None, printable(f"{type(exc).__name__}: {exc}", 200))
        else:
            try:
                tracker.record(hook, fits, None, rejected)
            except Exception as exc:  # supervised: one answer never ends the scrapes
                tracker.failed(hook, exc)

    while True:
        started = time.monotonic()
        await asyncio.gather(*(one(h) for h in tracker.hooks))
        try:
            tracker.limit()  # a blind episode starts and ends with the hooks, not with the next request
            tracker.published_at_best = tracker.at_best()
        except Exception as exc:  # supervised: whichever answer it was, none is used until the hooks answer again
            for hook in tracker.hooks:
                tracker.failed(hook, exc)
            tracker.published_at_best = None
            tracker.limit()
        await asyncio.sleep(max(0.0, poll_s - (time.monotonic() - started)))


__all__ = ["AT_BEST", "FIT_BUDGET", "FUTURE_SLACK_S", "GROWTH", "LAST_SUCCESS", "MAX_METRICS_BYTES", "MAX_PREFILL",
           "HookReading", "Limit", "LimitTracker", "RankFit", "fetch_metrics", "parse_fits", "parse_hook",
           "scrape_forever"]
