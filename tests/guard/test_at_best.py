"""The permanent refusal by memory: a prompt over what the deployment could take at best (the ranks'
`memtel_forecast_max_prefill_tokens_at_best`, read only where it can be trusted) gets the 400 no retry helps.

The safety rule first (telemetry/admission/at_best.py): a reading taken while the guard had a prefill in flight on the
replica is not used, nor one past the window, nor a replica with a stale hook or one without the gauge; unknown,
the refusal stays transient. Then the answer itself (refusal.py), and end to end with a real guard on loopback,
the OpenAI client and the queue.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import openai
import pytest

from telemetry.admission import at_best as at_best_module
from telemetry.admission import readings as readings_module
from telemetry.admission.at_best import AtBest
from telemetry.admission.readings import Readings
from telemetry.admission.refusal import refusal_for
from telemetry.guard.limit import Limit, LimitTracker, RankFit
from telemetry.guard.proxy import GuardLimits
from telemetry.url import parse_url
from tests.guard.servers import RunningGuard, StubHook, exposition, request


def deployment_at_best(trackers: list[Readings]) -> tuple[AtBest | None, str | None]:
    """The core's at-best over these replicas, on this process's clocks now."""
    return readings_module.deployment_at_best(trackers, time.monotonic(), time.time())


REJECTED = "memtel_guard_rejected_total"
OUTCOMES = "memtel_guard_queue_outcomes_total"
STATE: dict[str, object] = {"limit": 1000, "at_best": None, "at": None}


def fit(at_best: int | None, at: float, tokens: int = 1000, rank: str = "0") -> RankFit:
    return RankFit(rank, "node-a", tokens, 4e9, at, (), at_best)


# ---- the safety rule ------------------------------------------------------------------------------------------


def _tracker(*hooks: str) -> LimitTracker:
    return LimitTracker([parse_url(h) for h in hooks], stale_s=60)


def test_a_replica_is_known_only_with_every_rank_fresh_with_the_gauge_and_a_clean_reading():
    tracker = _tracker("http://a:9200", "http://b:9200")
    a, b = tracker.hooks
    now = time.time()
    tracker.record(a, [fit(5000, now, rank="0")], None)
    tracker.record(b, [fit(None, now, rank="1")], None)   # a hook older than the gauge
    best, why = deployment_at_best([tracker])
    assert best is None and "rank 1 on node node-a exports no at-best limit" in (why or "")
    tracker.record(b, [fit(4000, now, rank="1")], None)
    best, why = deployment_at_best([tracker])
    assert best is not None and (best.tokens, best.rank) == (4000, "1") and why is None   # the smallest rank
    tracker.record(b, [fit(4000, now - 120, rank="1")], None)   # its forecast is stale now
    assert deployment_at_best([tracker])[0] is None
    other = _tracker("http://c:9200")
    tracker.record(b, [fit(4000, now, rank="1")], None)
    assert deployment_at_best([tracker, other]) == (None, "http://c:9200/metrics: not fresh")  # a replica unseen
    other.record(other.hooks[0], [fit(9000, now)], None)
    assert deployment_at_best([tracker, other])[0].tokens == 9000   # the best replica's


# ---- the answer ------------------------------------------------------------------------------------------------


def _limit(rank_tokens: int = 1000) -> Limit:
    return Limit(rank_tokens, rank_tokens, 0, fit(None, time.time(), rank_tokens, rank="1"), "http://h:9200/metrics")


BEST = AtBest(1500, "3", "spark-2", "http://s2:9200/metrics", 1.0e9)


def test_over_the_at_best_limit_is_a_permanent_400_that_says_it_is_memory():
    refusal = refusal_for(2000, "words", _limit(), None, "prompt", BEST)
    error = refusal.body["error"]
    assert refusal.status == 400 and refusal.headers == (("x-should-retry", "false"),)   # no Retry-After
    assert (error["type"], error["code"], error["reason"]) == ("invalid_request_error", "context_length_exceeded",
                                                               "exceeds_memory_at_best")
    assert (error["limit_tokens_at_best"], error["limit_at_best_from"]) == (1500, "memory")
    assert (error["at_best_rank"], error["at_best_node"], error["retryable"]) == ("3", "spark-2", False)
    assert "at best 1,500 tokens, what rank 3 on node spark-2 could take with only its resident memory" in \
        error["message"]
    # Max-model-len binds where it is lower: the engine's own limit is said.
    lower = refusal_for(2000, "words", _limit(), 1200, "prompt", BEST).body["error"]
    assert (lower["reason"], lower["limit_tokens_at_best"], lower["limit_at_best_from"]) == (
        "context_length_exceeded", 1200, "max_model_len")
    # A byte bound proves nothing; within the at-best limit it is transient and names it.
    assert refusal_for(2000, "byte_bound", _limit(), None, "prompt", BEST).status == 503
    within = refusal_for(1200, "tokenize", _limit(), 4000, "prompt", BEST)
    assert within.status == 503 and within.body["error"]["limit_at_best_from"] == "memory"
    assert "at best 1,500 tokens (what rank 3 on node spark-2 could take with an empty cache)" in \
        within.body["error"]["message"]
    unknown = refusal_for(5000, "tokenize", _limit(), None, "prompt", None, "no clean reading")
    assert unknown.status == 503 and "the at-best memory limit is unknown: no clean reading" in \
        unknown.body["error"]["message"]


# ---- end to end: a real guard, a stub hook -------------------------------------------------------------------


@pytest.fixture(scope="module")
def hook():
    def text() -> str:
        return exposition(int(STATE["limit"]), node="node-a", rank="0", budget=4e9,  # type: ignore[call-overload]
                          at_best=STATE["at_best"], forecast_time=STATE["at"])  # type: ignore[arg-type]
    server = StubHook(text)
    yield server
    server.stop()


@pytest.fixture
def make_guard(start_guard, hook, monkeypatch):
    monkeypatch.setattr(at_best_module, "CLEAN_SLACK_S", 0.05)   # loopback: one clock, no margin of seconds needed

    def make(queue_s: float = 0.0) -> RunningGuard:
        return start_guard([hook.url], limits=GuardLimits(queue_s=queue_s, max_queued=8))

    return make


@pytest.fixture(autouse=True)
def _clean(upstream):
    STATE.update(limit=1000, at_best=None, at=None)
    upstream.seen.clear()
    upstream.hold = None
    upstream.max_model_len = None
    yield
    if upstream.hold is not None:
        upstream.hold.set()


def on_loop(guard: RunningGuard, call):
    """`call()` on the guard's event loop (the tracker is the loop's), its answer here."""
    async def run():
        return call()
    return asyncio.run_coroutine_threadsafe(run(), guard.loop).result(5)


def _ids(n: int) -> dict:
    return {"model": "stub", "prompt": [7] * n, "max_tokens": 4}


def _posts(upstream) -> list[str]:
    return [p for p in upstream.paths() if p == "/v1/completions"]


def test_the_openai_client_gets_a_bad_request_at_once_for_a_prompt_over_the_at_best_limit(make_guard, upstream):
    STATE["at_best"] = 1500
    guard = make_guard()
    guard.wait_for(lambda: on_loop(guard, guard.tracker.at_best) is not None)
    with openai.OpenAI(base_url=guard.url + "/v1", api_key="k") as client, \
            pytest.raises(openai.BadRequestError) as caught:   # default max_retries=2, untouched
        started = time.perf_counter()
        client.completions.create(model="stub", prompt=[7] * 2000, max_tokens=4)
    assert time.perf_counter() - started < 1.0
    error = caught.value
    assert error.status_code == 400 and error.code == "context_length_exceeded"
    assert error.response.headers["x-should-retry"] == "false" and "retry-after" not in error.response.headers
    body = error.response.json()["error"]
    assert (body["reason"], body["limit_tokens_at_best"], body["limit_at_best_from"]) == ("exceeds_memory_at_best",
                                                                                          1500, "memory")
    assert guard.sample(REJECTED, {"reason": "exceeds_memory_at_best"}) == 1   # one request: no retry
    assert guard.sample("memtel_guard_limit_tokens_at_best", {"node": "node-a", "rank": "0"}) == 1500
    assert _posts(upstream) == []
    status, _h, _d = request(guard.url, "POST", "/v1/completions", _ids(1200))   # within it: transient, as before
    assert status == 503


def test_without_the_gauge_or_with_a_reading_taken_mid_prefill_the_refusal_stays_transient(make_guard, upstream):
    guard = make_guard()   # a hook older than the gauge
    status, _h, data = request(guard.url, "POST", "/v1/completions", _ids(5000))
    assert status == 503 and "the at-best memory limit is unknown" in json.loads(data)["error"]["message"]
    assert guard.sample("memtel_guard_limit_tokens_at_best", {"node": "node-a", "rank": "0"}) is None
    upstream.hold = threading.Event()   # an admitted prefill stays in flight ...
    flight = threading.Thread(target=request, args=(guard.url, "POST", "/v1/completions", _ids(100)), daemon=True)
    flight.start()
    guard.wait_for(lambda: guard.tracker.in_prefill_tokens == 100)
    STATE["at_best"] = 1200   # ... while the hook's snapshots say 1,200 at best
    scrapes = guard.tracker.hooks[0]
    guard.wait_for(lambda: scrapes.fits and scrapes.fits[0].at_best_tokens == 1200)
    time.sleep(0.2)   # several scrapes of it
    status, _h, data = request(guard.url, "POST", "/v1/completions", _ids(1500))
    assert status == 503, data   # the mid-prefill reading understates what the rank takes at rest: not permanent
    upstream.hold.set()
    flight.join(5)
    guard.wait_for(lambda: on_loop(guard, guard.tracker.at_best) is not None)   # clean once the prefill is over
    status, _h, data = request(guard.url, "POST", "/v1/completions", _ids(1500))
    assert status == 400 and json.loads(data)["error"]["reason"] == "exceeds_memory_at_best"
    STATE["at_best"] = None   # the engine restarts with an older hook: unknown again, transient again
    guard.wait_for(lambda: scrapes.fits and scrapes.fits[0].at_best_tokens is None)
    status, _h, _d = request(guard.url, "POST", "/v1/completions", _ids(1500))
    assert status == 503


def test_a_request_admitted_blind_is_in_flight_too(upstream, hook):
    hook.down = True   # blind from the start; --when-blind admit lets it through unchecked
    guard = RunningGuard(upstream.url, [hook.url])
    try:
        upstream.hold = threading.Event()
        flight = threading.Thread(target=request, args=(guard.url, "POST", "/v1/completions", _ids(100)),
                                  daemon=True)
        flight.start()
        guard.wait_for(lambda: guard.tracker.book.in_flight == 1)   # its prefill makes the snapshots unclean
        upstream.hold.set()
        flight.join(5)
        guard.wait_for(lambda: guard.tracker.book.in_flight == 0)
    finally:
        hook.down = False
        guard.stop()


def test_a_queued_prompt_that_becomes_permanent_leaves_the_queue_with_the_400(make_guard, upstream):
    guard = make_guard(queue_s=5.0)
    answer: list[tuple[int, dict, bytes]] = []
    waiter = threading.Thread(target=lambda: answer.append(request(guard.url, "POST", "/v1/completions", _ids(1500))),
                              daemon=True)
    waiter.start()
    guard.wait_for(lambda: guard.sample("memtel_guard_queue_depth") == 1)
    time.sleep(0.1)
    assert not answer   # waiting: the at-best limit is not known yet
    queued_at = time.monotonic()
    STATE["at_best"] = 1200
    waiter.join(5)
    status, headers, data = answer[0]
    assert status == 400 and headers["x-should-retry"] == "false" and time.monotonic() - queued_at < 1.0
    assert json.loads(data)["error"]["reason"] == "exceeds_memory_at_best"
    assert guard.sample(OUTCOMES, {"outcome": "refused"}) == 1 and _posts(upstream) == []


def test_a_rank_is_never_taken_below_what_its_gauges_say_now():
    tracker = _tracker("http://a:9200")
    hook = tracker.hooks[0]
    now = time.time()
    tracker.record(hook, [fit(1000, now - 10, tokens=1000)], None)   # a clean reading: 1,000 at best
    tracker.book.started(time.time())                                 # then prefills in flight: unclean readings ...
    tracker.record(hook, [fit(1100, now, tokens=1200)], None)         # ... that still prove 1,200 fit now
    best, _ = deployment_at_best([tracker])
    assert best is not None and best.tokens == 1200   # a prompt of 1,100 to 1,200 is never refused for good
