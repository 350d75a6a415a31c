"""Reading the ranks' fits from a hook's exposition text, and the limit they set."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from telemetry.errors import ConfigError
from telemetry.guard import limit
from telemetry.guard.limit import LimitTracker, RankFit, parse_fits, scrape_forever
from telemetry.guard.replicas import hook_targets
from telemetry.url import parse_url
from tests.guard.servers import StubHook, exposition, request


def test_parse_fits_reads_each_rank_and_its_forecasts():
    text = exposition(1234, rank="0", node="a", budget=2e9, forecast_time=100.0, growth={2000: 3e9, 1000: 1e9}) + \
        exposition(99, rank="1", node="b").split("\n", 3)[3]
    fits = sorted(parse_fits(text), key=lambda f: f.rank)
    assert [(f.rank, f.node, f.max_prefill_tokens) for f in fits] == [("0", "a", 1234), ("1", "b", 99)]
    assert fits[0].budget_bytes == 2e9 and fits[0].forecast_time == 100.0
    assert fits[0].growth_bytes == ((1000, 1e9), (2000, 3e9))
    assert fits[0].forecast_for(1500) == (2000, 3e9) and fits[0].forecast_for(2001) is None


def test_a_hook_without_the_gauge_has_no_fit():
    assert parse_fits('memtel_hook_calls_total{site="x",rank="0",node="a"} 3\n') == []
    assert parse_fits('memtel_forecast_max_prefill_tokens{rank="0",node="a"} NaN\n') == []


def test_reserve_scales_the_rank_limit_by_the_budget_left():
    fit = RankFit("0", "a", 100_000, 4 << 30, None)
    assert fit.tokens(0) == 100_000
    assert fit.tokens(1 << 30) == 75_000
    assert fit.tokens(8 << 30) == 0
    assert RankFit("0", "a", 500, None, None).tokens(1 << 30) == 500  # no budget exported: nothing to scale


def test_the_limit_is_the_smallest_fresh_rank_less_the_tokens_in_prefill():
    tracker = LimitTracker([parse_url("http://127.0.0.1:1"), parse_url("http://127.0.0.1:2")],
                           stale_s=5)
    assert tracker.limit() is None and tracker.blind
    tracker.record(tracker.hooks[0], [RankFit("0", "a", 900, None, time.time())], None)
    tracker.record(tracker.hooks[1], [RankFit("1", "b", 700, None, time.time()),
                                      RankFit("2", "b", 50, None, time.time() - 60)], None)  # stale: not used
    tracker.hold(200)
    limit = tracker.limit()
    assert limit is not None and (limit.tokens, limit.rank_tokens, limit.fit.rank) == (500, 700, "1")
    tracker.release(200)
    assert tracker.limit().tokens == 700 and not tracker.blind and tracker.blind_episodes == 1


def test_blind_names_the_failing_scrape_even_where_its_last_forecast_aged_out_first():
    """A hook that now fails (HTTP 503) and whose last forecast is also older than stale_s: the reason is the
    failure (its forecast ages out a scrape's latency before its answer does; seen under load)."""
    tracker = LimitTracker([parse_url("http://127.0.0.1:9200/metrics")], stale_s=1.0)
    hook = tracker.hooks[0]
    tracker.record(hook, [RankFit("0", "a", 900, None, time.time() - 5)], None)  # answered now, forecast old
    assert tracker.limit() is None and "forecast older than 1 s" in tracker.why_blind()
    tracker.record(hook, None, "HTTP 503")
    assert tracker.why_blind() == "http://127.0.0.1:9200/metrics: HTTP 503"


@pytest.mark.parametrize("text", ["ftp://h:1", "http://", "not a url", "http://h:99999"])
def test_hook_urls_that_are_not_http(text):
    with pytest.raises(ConfigError, match=r"^--hooks: "):
        hook_targets(text)


def test_hook_url_defaults_and_credentials():
    [target] = hook_targets("http://user:pw@127.0.0.1:9200")
    assert (target.url, target.path, target.authorization) == ("http://127.0.0.1:9200/metrics", "/metrics",
                                                              "Basic dXNlcjpwdw==")
    assert "pw" not in target.url


def test_without_a_reserve_the_limit_is_the_ranks_own():
    tracker = LimitTracker([parse_url("http://127.0.0.1:1")], stale_s=5)
    assert tracker.why_blind() == "http://127.0.0.1:1/metrics: no answer yet"
    assert tracker.limit() is None
    started = time.monotonic()
    assert tracker.blind_seconds_now(started + 10) >= 10   # the episode still going counts
    tracker.record(tracker.hooks[0], [RankFit("0", "a", 1000, 8 << 30, time.time())], None)
    limit = tracker.limit()
    assert limit is not None and limit.tokens == 1000   # a budget exported, no byte of it reserved


def test_a_hooks_answer_is_parsed_while_the_loop_keeps_running(monkeypatch):
    parse = limit.parse_hook
    ticks = 0
    ticked_during_parse: list[bool] = []
    loop_threads: list[bool] = []
    loop_thread: threading.Thread | None = None

    def held_parse(text: str):
        started_at = ticks
        ticked = threading.Event()
        for _ in range(100):  # at most a second
            if ticks > started_at + 1:
                ticked.set()
                break
            ticked.wait(0.01)
        ticked_during_parse.append(ticked.is_set())
        loop_threads.append(threading.current_thread() is loop_thread)
        return parse(text)

    monkeypatch.setattr(limit, "parse_hook", held_parse)
    # A large answer: a hook with many ranks' series (about 300 kB), as a big node's would be.
    hook = StubHook(lambda: exposition(1000) + "".join(
        f'memtel_hook_calls_total{{site="s{i}",rank="0",node="node-a"}} {i}.0\n' for i in range(5_000)))
    tracker = LimitTracker([parse_url(hook.url)], stale_s=30.0)

    async def main() -> None:
        nonlocal ticks, loop_thread
        loop_thread = threading.current_thread()
        scraper = asyncio.ensure_future(scrape_forever(tracker, 0.05, timeout_s=5.0))
        try:
            for _ in range(1000):
                if tracker.hooks[0].fits or tracker.hooks[0].error:
                    break
                ticks += 1
                await asyncio.sleep(0.005)
        finally:
            scraper.cancel()
            await asyncio.gather(scraper, return_exceptions=True)

    try:
        asyncio.run(main())
    finally:
        hook.stop()
    assert tracker.hooks[0].error is None and tracker.hooks[0].fits, tracker.hooks[0].error
    assert ticked_during_parse[0], "the event loop stood still while the hook's answer was parsed"
    assert loop_threads[0] is False


def test_one_hostile_hook_answer_never_blinds_the_guard_unseen_and_the_next_sane_one_is_used(start_guard, upstream):
    # Issue 41: one scrape of 1e308 gauges with --reserve-mb raised OverflowError in RankFit.tokens, ended the
    # scrapes for good, and the guard admitted prompts over the limit while /metrics said memtel_guard_blind 0.
    hook = StubHook(lambda: exposition(1e308, budget=1e308))  # type: ignore[arg-type]
    try:
        guard = start_guard([hook.url], reserve_mb=1024,
                            ready=lambda g: hook.scrapes >= 2 and g.sample("memtel_guard_blind") == 1)
        status, headers, _ = request(guard.url, "GET", "/health")
        assert status == 200 and "memtel_forecast_max_prefill_tokens is 1e+308" in headers["x-memtel-guard-blind"]
        hook.text = lambda: exposition(1000)   # the hook answers sanely again: the scrapes went on and use it
        guard.wait_for(lambda: guard.sample("memtel_guard_blind") == 0 and guard.tracker.published is not None)
        assert guard.tracker.published.tokens == 875   # --reserve-mb 1024 of its 8 GiB budget
        assert request(guard.url, "POST", "/v1/completions", {"prompt": "w " * 5000})[0] in (400, 503)
        assert "/v1/completions" not in upstream.paths()   # refused by the guard, never sent on
    finally:
        hook.stop()


def test_a_failure_in_the_guards_own_work_on_an_answer_is_logged_once_counted_and_the_scrapes_go_on(
        start_guard, monkeypatch, caplog):
    def broken(self):
        raise RuntimeError("the readings' arithmetic failed")

    hook = StubHook(lambda: exposition(1000))
    try:
        monkeypatch.setattr(LimitTracker, "at_best", broken)
        with caplog.at_level(logging.ERROR, logger="memtel.guard"):
            guard = start_guard([hook.url], ready=lambda g: hook.scrapes >= 4)
            url = hook.url + "/metrics"
            guard.wait_for(lambda: (guard.sample("memtel_guard_hook_scrape_failures_total", {"hook": url}) or 0) >= 3)
            assert guard.sample("memtel_guard_blind") == 1   # its forecast forgotten: blind, and said so
        said = [r.getMessage() for r in caplog.records if "RuntimeError" in r.getMessage()]
        assert len(said) == 1 and "the scrapes go on" in said[0]
        assert "RuntimeError: the readings' arithmetic failed" in guard.tracker.why_blind()
    finally:
        hook.stop()
