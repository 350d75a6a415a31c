"""A replica's readings: its hooks' last answers, the tokens its admitted prefills hold, the limit in force.

Each hook exporter's /metrics gives, per `rank` and `node`, `memtel_forecast_max_prefill_tokens` (the longest cold
prefill that fits the memory the rank may still take), `memtel_forecast_fit_budget_bytes` (that memory),
`memtel_forecast_last_success_timestamp_seconds` (when the forecast's snapshot was taken),
`memtel_forecast_reserved_growth_bytes{tokens}` (the bytes forecast for fixed lengths, quoted in a refusal) and
`memtel_forecast_max_prefill_tokens_at_best` (what the rank could take with an empty cache: the permanent limit,
kept as at_best.py says; a replica's and the deployment's at-best from it: `replica_at_best`,
`deployment_at_best`). A rank is fresh while its hook answered within `stale_s` and its forecast is younger
than `stale_s`. The limit is the smallest fresh rank's tokens (cut by `reserve_bytes`, see `RankFit.tokens`), less
the tokens of admitted requests still in their prefill (`hold`/`release`). No fresh rank: blind.

A hook is not trusted further than its gauges make sense: a rank whose tokens or budget is NaN, infinite,
negative or past what a node can have (tokens over `MAX_TOKENS`, bytes over `MAX_NODE_BYTES`), or whose forecast
time is missing, not a positive finite number, or in the future, is not fresh, and `why_blind` says why: one
absurd gauge never reaches the limit's arithmetic. A hook that answers but exports no forecast at all (an engine
started without the forecast) is said to be so, with the variable that turns it on (`NO_GAUGE_HINT`).

Pure: the caller reads the hooks and the clocks; every method that depends on time takes `now` (monotonic) and
`wall` (unix time, the hooks' forecast stamps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from telemetry import hook_env
from telemetry.admission.at_best import AT_BEST_WINDOW_S, AtBest, AtBestBook, best_replica
from telemetry.catalogue import metrics as catalogue
from telemetry.errors import printable
from telemetry.scrape import parse
from telemetry.url import Endpoint

MAX_PREFILL = catalogue.FORECAST_MAX_PREFILL_TOKENS.series
FIT_BUDGET = catalogue.FORECAST_FIT_BUDGET.series
LAST_SUCCESS = catalogue.FORECAST_LAST_SUCCESS.series
GROWTH = catalogue.FORECAST_RESERVED_GROWTH.series
AT_BEST = catalogue.FORECAST_MAX_PREFILL_TOKENS_AT_BEST.series
_WANTED = (catalogue.FORECAST_MAX_PREFILL_TOKENS, catalogue.FORECAST_FIT_BUDGET, catalogue.FORECAST_LAST_SUCCESS,
           catalogue.FORECAST_RESERVED_GROWTH, catalogue.FORECAST_MAX_PREFILL_TOKENS_AT_BEST)
# How far ahead of the guard's clock a forecast's timestamp may be (the hooks' nodes' clocks, NTP-synced,
# differ by milliseconds); further ahead, the timestamp is wrong and would never age.
FUTURE_SLACK_S = 2.0
# What a hook may say and still be believed: a prompt's tokens fit in 2^31, and no node has 16 TiB of memory
# (as `memtel guard --reserve-mb`'s ceiling). Past these, a gauge is a broken or hostile exporter's.
MAX_TOKENS = 1 << 31
MAX_NODE_BYTES = float(1 << 44)
MAX_LABEL_CHARS = 64  # a rank's or node's label as quoted (a host name is at most 63 characters a part)
# What a hook that answers without the gauge lacks: its engine runs without the forecast (docs/guard.md).
NO_GAUGE_HINT = ("its engine runs without the forecast: start it with the memtel hook on a known engine (vLLM, "
                 f"SGLang, the lab) or set {hook_env.FORECAST_TOKENS}")


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

    def forecast_at(self, tokens: int) -> tuple[float, tuple[int, ...]] | None:
        """The reserved growth forecast for a prefill of `tokens` itself, and the hook's lengths it comes from: the
        hook's own figure where it forecasts that length, else the straight line between the nearest lengths it
        forecasts around it (from 0 bytes at 0 tokens below its shortest). A prefill's growth is convex in its
        length (each chunk's logits span the context so far), so the line lies above the curve: never low. None
        above the longest length it forecasts."""
        below, above = (0, 0.0), None
        for length, growth in self.growth_bytes:
            if length == tokens:
                return growth, (length,)
            if length < tokens:
                below = (length, growth)
            else:
                above = (length, growth)
                break
        if above is None or tokens < 0:
            return None
        (lo, lo_bytes), (hi, hi_bytes) = below, above
        estimate = lo_bytes + (hi_bytes - lo_bytes) * (tokens - lo) / (hi - lo)
        return estimate, ((lo, hi) if lo else (hi,))

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


def _bad(value: float | None, *, positive: bool = False, most: float = math.inf) -> bool:
    return value is not None and (not math.isfinite(value) or value < 0 or (positive and value == 0)
                                  or value > most)


def parse_hook(text: str) -> tuple[list[RankFit], list[str]]:
    """The ranks' forecasts in a hook's exposition text (only the wanted series are parsed), and why each rank
    that exports nonsense (a NaN, infinite or negative gauge or forecast time) is left out."""
    values: dict[tuple[str, str], dict[str, float]] = {}
    growth: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for sample in parse(text, only=_WANTED).samples:   # the other lines are not parsed
        # The labels reach refusals, /health and the log: escaped and cut here, once (a hook's text is outside's).
        key = (printable(sample.labels.get("rank", ""), MAX_LABEL_CHARS),
               printable(sample.labels.get("node", ""), MAX_LABEL_CHARS))
        if sample.name == GROWTH:
            length = sample.labels.get("tokens", "")
            if length.isdigit() and len(length) <= 18 and not _bad(sample.value, most=MAX_NODE_BYTES):
                growth.setdefault(key, []).append((int(length), sample.value))
        elif sample.name in (MAX_PREFILL, FIT_BUDGET, LAST_SUCCESS, AT_BEST):
            values.setdefault(key, {})[sample.name] = sample.value
    fits, rejected = [], []
    for (rank, node), found in values.items():
        tokens, budget, at = found.get(MAX_PREFILL), found.get(FIT_BUDGET), found.get(LAST_SUCCESS)
        at_best = found.get(AT_BEST)
        if tokens is None:
            continue
        bad = [f"{name} is {value:g}" for name, value, positive, most in ((MAX_PREFILL, tokens, False, MAX_TOKENS),
                                                                         (FIT_BUDGET, budget, False, MAX_NODE_BYTES),
                                                                         (LAST_SUCCESS, at, True, math.inf),
                                                                         (AT_BEST, at_best, False, MAX_TOKENS))
               if _bad(value, positive=positive, most=most)]
        if bad:
            rejected.append(f"rank {rank} on node {node}: {', '.join(bad)}")
            continue
        fits.append(RankFit(rank, node, int(tokens), budget, at, tuple(sorted(growth.get((rank, node), []))),
                            None if at_best is None else int(at_best)))
    return fits, rejected


@dataclass
class HookReading:
    """One hook's last answer as the caller reported it (`Readings.record`)."""

    target: Endpoint  # the hook's exporter (`--hooks`: telemetry/url.py parses it)
    fits: list[RankFit] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)  # ranks whose gauges make no sense, and why
    scraped_at: float | None = None  # monotonic time of the last successful scrape
    error: str | None = None  # why the last scrape failed
    failures: int = 0

    def without_gauge(self) -> bool:
        """It answered and exports no forecast at all: its engine runs without the forecast."""
        return self.scraped_at is not None and self.error is None and not self.fits and not self.rejected


@dataclass(frozen=True)
class Limit:
    """The limit in force at one moment, and what set it."""

    tokens: int  # what a prompt may hold now: the rank's limit less the tokens in prefill
    rank_tokens: int  # the limiting rank's longest fitting prefill (after --reserve-mb)
    in_prefill_tokens: int
    fit: RankFit
    hook: str


class Readings:
    """One replica's hooks' last answers, the tokens held by its admitted prefills, its at-best book and its blind
    episodes. Pure: the caller passes the clocks."""

    def __init__(self, targets: list[Endpoint], *, stale_s: float, reserve_bytes: float = 0.0,
                 at_best_window_s: float = AT_BEST_WINDOW_S) -> None:
        self.hooks = [HookReading(t) for t in targets]
        self.book = AtBestBook(at_best_window_s)  # clean at-best readings, prefills in flight (at_best.py)
        self.stale_s = stale_s
        self.reserve_bytes = reserve_bytes
        self.in_prefill_tokens = 0
        self.blind: bool | None = None  # None until the first `note_blind`
        self.blind_seconds = 0.0
        self.blind_episodes = 0
        self._blind_since: float | None = None

    # -- the hooks' answers ----------------------------------------------------------------------------------
    def record_at(self, hook: HookReading, fits: list[RankFit] | None, error: str | None, rejected: list[str] | None,
                  now: float, wall: float) -> bool:
        """A hook's answer (`fits`) or why there is none (`error`); whether the limit may have moved (a new
        forecast, or the last one gone stale: a waiter may be decided again)."""
        if fits is not None:
            hook.fits, hook.scraped_at, hook.error = fits, now, None
            hook.rejected = rejected or []
            self.book.observe(hook.target.url, fits, wall)
            return True
        hook.error = error
        hook.failures += 1
        return hook.scraped_at is None or now - hook.scraped_at > self.stale_s

    def fresh(self, now: float, wall: float) -> list[tuple[HookReading, RankFit]]:
        found: list[tuple[HookReading, RankFit]] = []
        for hook in self.hooks:
            if hook.scraped_at is None or now - hook.scraped_at > self.stale_s:
                continue
            found.extend((hook, fit) for fit in hook.fits if fit.stale_reason(wall, self.stale_s) is None)
        return found

    def without_gauge(self) -> list[str]:
        """The hooks that answer without any forecast (their engines run without it)."""
        return [hook.target.url for hook in self.hooks if hook.without_gauge()]

    def why_blind_at(self, now: float, wall: float) -> str:
        parts = []
        for hook in self.hooks:
            # The last scrape's failure first: its last forecast also ages out while it fails, and the failure is
            # the cause (the forecast can age past stale_s a scrape's latency before the answer does).
            if hook.error is not None or hook.scraped_at is None or now - hook.scraped_at > self.stale_s:
                parts.append(f"{hook.target.url}: {hook.error or 'no answer yet'}")
            elif not hook.fits and not hook.rejected:
                parts.append(f"{hook.target.url}: exports no {MAX_PREFILL} ({NO_GAUGE_HINT})")
            else:
                reasons = [*hook.rejected, *(r for f in hook.fits if (r := f.stale_reason(wall, self.stale_s)))]
                parts.append(f"{hook.target.url}: {'; '.join(dict.fromkeys(reasons)) or 'fresh'}")
        return "; ".join(parts)

    # -- the limit ---------------------------------------------------------------------------------------------
    def limit_at(self, now: float, wall: float) -> Limit | None:
        """The limit in force at (`now`, `wall`), or None when blind. Changes nothing."""
        fresh = self.fresh(now, wall)
        if not fresh:
            return None
        hook, fit = min(fresh, key=lambda hf: hf[1].tokens(self.reserve_bytes))
        rank_tokens = fit.tokens(self.reserve_bytes)
        return Limit(max(0, rank_tokens - self.in_prefill_tokens), rank_tokens, self.in_prefill_tokens, fit,
                     hook.target.url)

    def hold_at(self, tokens: int, wall: float) -> None:
        """An admitted request's prefill starts (every admission, 0 tokens for one admitted blind)."""
        self.in_prefill_tokens += tokens
        self.book.started(wall)

    def release_at(self, tokens: int, wall: float) -> None:
        """Its prefill is over: once for each hold."""
        self.in_prefill_tokens = max(0, self.in_prefill_tokens - tokens)
        self.book.ended(wall)

    # -- blind episodes ----------------------------------------------------------------------------------------
    def note_blind(self, blind: bool, now: float) -> str | None:
        """Account the blind time up to `now`; "blind" when an episode starts, "sees" when one ends, else None."""
        change = None
        if blind and not self.blind:
            self.blind_episodes += 1
            self._blind_since = now
            change = "blind"
        elif not blind and self.blind:
            self._account(now)
            self._blind_since = None
            change = "sees"
        elif blind:
            self._account(now)
        self.blind = blind
        return change

    def blind_seconds_now(self, now: float) -> float:
        since = self._blind_since
        return self.blind_seconds + (now - since if self.blind and since is not None else 0.0)

    def _account(self, now: float) -> None:
        if self._blind_since is not None:
            self.blind_seconds += now - self._blind_since
            self._blind_since = now


def replica_at_best(tracker: Readings, now: float, wall: float) -> tuple[AtBest | None, str | None]:
    """(a replica's at-best: its smallest rank's highest clean reading, or its gauges now where higher; why it is
    unknown) at monotonic time `now`, unix time `wall`. Known only where every hook is fresh and every rank has a
    clean reading."""
    fresh = {(hook.target.url, fit.rank, fit.node) for hook, fit in tracker.fresh(now, wall)}
    found: list[AtBest] = []
    for hook in tracker.hooks:
        url = hook.target.url
        if not hook.fits or any((url, fit.rank, fit.node) not in fresh for fit in hook.fits):
            return None, f"{url}: not fresh"
        for fit in hook.fits:
            if fit.at_best_tokens is None:
                return None, (f"rank {fit.rank} on node {fit.node} exports no at-best limit (a hook older than "
                              "the gauge)")
            best = tracker.book.best(url, fit, wall)
            if best is None:
                return None, (f"rank {fit.rank} on node {fit.node}: no at-best limit measured in the last "
                              f"{tracker.book.window_s:g} s while the guard had no prefill in flight")
            # The rank's gauges now are lower bounds of its at-best too (what fits now fits at rest; a snapshot
            # taken mid-prefill understates it): never below them, where they are above the clean readings.
            now = max(fit.at_best_tokens, fit.max_prefill_tokens)
            tokens, at = (best[0], best[1]) if best[0] >= now else (now, fit.forecast_time or best[1])
            found.append(AtBest(tokens, fit.rank, fit.node, url, at))
    if not found:
        return None, "no rank"
    return min(found, key=lambda a: a.tokens), None


def deployment_at_best(trackers: Sequence[Readings], now: float, wall: float) -> tuple[AtBest | None, str | None]:
    """(the deployment's at-best: the best replica's, None unless every replica's is known; why it is not)."""
    found = [replica_at_best(tracker, now, wall) for tracker in trackers]
    best = best_replica([best for best, _why in found])
    if best is not None:
        return best, None
    return None, "; ".join(why for _best, why in found if why) or "no replica"


__all__ = ["AT_BEST", "FIT_BUDGET", "GROWTH", "LAST_SUCCESS", "MAX_NODE_BYTES", "MAX_PREFILL", "MAX_TOKENS",
           "NO_GAUGE_HINT", "HookReading", "Limit", "RankFit", "Readings", "deployment_at_best", "parse_fits",
           "parse_hook", "replica_at_best"]
