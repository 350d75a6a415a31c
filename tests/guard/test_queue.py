"""The guard's queue (--queue-s, --max-queued): a prompt that does not fit now waits for room instead of a 503."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from telemetry.guard.proxy import GuardLimits
from tests.guard.servers import RunningGuard, StubHook, exposition, request

OUTCOMES = "memtel_guard_queue_outcomes_total"
DEPTH = "memtel_guard_queue_depth"
STATE = {"limit": 1000}


@pytest.fixture(scope="module")
def hook():
    server = StubHook(lambda: exposition(STATE["limit"], node="node-a", rank="0", budget=4e9))
    yield server
    server.stop()


@pytest.fixture
def make_guard(start_guard, hook):
    def make(queue_s: float = 2.0, max_queued: int = 8, stale_s: float = 2.0) -> RunningGuard:
        return start_guard([hook.url], stale_s=stale_s, limits=GuardLimits(queue_s=queue_s, max_queued=max_queued),
                           ready=lambda g: g.tracker.published is not None
                           and g.tracker.published.rank_tokens == STATE["limit"])

    return make


@pytest.fixture(autouse=True)
def _clean(upstream, hook):
    STATE["limit"] = 1000
    hook.down = False
    upstream.seen.clear()
    upstream.hold = upstream.gate = None
    upstream.max_model_len = None
    yield
    if upstream.hold is not None:
        upstream.hold.set()
    upstream.max_model_len = None


def ids(n: int, tag: int = 1) -> dict:
    return {"model": "stub", "prompt": [tag] * n, "max_tokens": 4}


class Call(threading.Thread):
    """One request on its own thread: status, headers, body and when it was answered."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.started = time.monotonic()
        self.result: tuple[int, dict, bytes] | None = None
        self.error: OSError | None = None
        self.answered_at = 0.0
        self.start()

    def run(self) -> None:
        try:
            self.result = request(self.url, "POST", "/v1/completions", self.body)
        except OSError as exc:  # kept for outcome(): a failed test must not leave a thread exception to the next
            self.error = exc
        self.answered_at = time.monotonic()

    def outcome(self, timeout: float = 10.0) -> tuple[int, dict, bytes]:
        self.join(timeout)
        assert self.result is not None, f"no answer: {self.error!r}"
        return self.result


def past_pass_s(guard, queued_at: float) -> None:
    """Sleep until a waiter queued no later than `queued_at` has waited past --queue-s's pass window."""
    time.sleep(max(0.0, queued_at + guard.proxy.queue.pass_s + 0.05 - time.monotonic()))


def forwarded(upstream, tag: int) -> bool:
    return any(path == "/v1/completions" and json.loads(body)["prompt"][0] == tag
               for _m, path, body in list(upstream.seen))


def test_a_prompt_waits_for_a_hold_to_be_released_then_goes_through(make_guard, upstream, hook):
    guard = make_guard()
    hook.down = True  # no scrape wakes the queue from here (the limit stays fresh for --stale-s): the release must
    upstream.hold = threading.Event()
    first = Call(guard.url, ids(600, tag=1))  # holds 600 of 1000 while its prefill runs
    guard.wait_for(lambda: guard.tracker.in_prefill_tokens == 600)
    second = Call(guard.url, ids(600, tag=2))  # does not fit beside it: waits
    guard.wait_for(lambda: guard.sample(DEPTH) == 1)
    time.sleep(0.1)
    assert not forwarded(upstream, 2) and second.result is None
    released = time.monotonic()
    upstream.hold.set()  # the first answers: its hold goes, the second is woken
    assert first.outcome()[0] == 200
    status, _headers, data = second.outcome()
    assert status == 200 and b"alpha" in data and second.answered_at >= released
    # decided on the limit (not blind: the hook is down, its forecast goes stale after 2 s)
    assert guard.sample("memtel_guard_admitted_total", {"path": "/v1/completions", "counted_by": "token_ids"}) == 2
    assert guard.sample(OUTCOMES, {"outcome": "admitted"}) == 1 and guard.sample(DEPTH) == 0
    assert guard.sample("memtel_guard_queue_wait_seconds_count") == 1
    assert guard.sample("memtel_guard_rejected_total", {"reason": "in_prefill"}) == 0  # it was answered 200


def test_a_prompt_waits_for_the_hook_limit_to_rise_then_goes_through(make_guard, upstream):
    guard = make_guard()
    STATE["limit"] = 500
    guard.wait_for(lambda: guard.tracker.published.rank_tokens == 500)
    call = Call(guard.url, ids(800))
    guard.wait_for(lambda: guard.sample(DEPTH) == 1)
    time.sleep(0.1)
    assert not forwarded(upstream, 1)
    raised = time.monotonic()
    STATE["limit"] = 1000  # the next scrape (every 50 ms) wakes it
    status, _headers, _data = call.outcome()
    assert status == 200 and call.answered_at >= raised and forwarded(upstream, 1)
    assert guard.sample(OUTCOMES, {"outcome": "admitted"}) == 1


def test_after_the_wait_it_is_a_503_with_retry_after_and_should_retry(make_guard, upstream):
    guard = make_guard(queue_s=0.3)
    started = time.monotonic()
    status, headers, data = request(guard.url, "POST", "/v1/completions", ids(1500))
    waited = time.monotonic() - started
    assert status == 503 and 0.3 <= waited < 2.0
    assert headers["retry-after"] == "10" and headers["x-should-retry"] == "true"
    error = json.loads(data)["error"]
    assert error["reason"] == "would_not_fit" and error["queued_s"] >= 0.3 and "queue" in error["message"]
    assert guard.sample(OUTCOMES, {"outcome": "timed_out"}) == 1 and guard.sample(DEPTH) == 0
    assert guard.sample("memtel_guard_rejected_total", {"reason": "would_not_fit"}) == 1  # once, not per wake
    assert not forwarded(upstream, 1)


def test_past_max_queued_the_503_comes_at_once(make_guard, upstream):
    guard = make_guard(queue_s=5.0, max_queued=1)
    STATE["limit"] = 500
    guard.wait_for(lambda: guard.tracker.published.rank_tokens == 500)
    waiting = Call(guard.url, ids(800, tag=1))
    guard.wait_for(lambda: guard.sample(DEPTH) == 1)
    started = time.monotonic()
    status, headers, data = request(guard.url, "POST", "/v1/completions", ids(800, tag=2))
    assert status == 503 and time.monotonic() - started < 0.5 and headers["x-should-retry"] == "true"
    assert "--max-queued" in json.loads(data)["error"]["queue"]
    assert guard.sample(OUTCOMES, {"outcome": "queue_full"}) == 1
    STATE["limit"] = 1000
    assert waiting.outcome()[0] == 200  # the one queued is not lost
    assert forwarded(upstream, 1) and not forwarded(upstream, 2)


def test_a_client_that_leaves_while_queued_leaves_the_queue_at_once(make_guard, upstream):
    guard = make_guard(queue_s=5.0)
    body = json.dumps(ids(1500)).encode()
    sock = socket.create_connection(("127.0.0.1", guard.port), timeout=5)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    guard.wait_for(lambda: guard.sample(DEPTH) == 1)
    sock.close()
    closed = time.monotonic()
    guard.wait_for(lambda: guard.sample(DEPTH) == 0, timeout=1.0)
    assert time.monotonic() - closed < 0.5  # not at --queue-s (5 s)
    assert guard.sample(OUTCOMES, {"outcome": "client_left"}) == 1
    STATE["limit"] = 2000  # room now: nothing of it goes upstream
    guard.wait_for(lambda: guard.tracker.published.rank_tokens == 2000)
    time.sleep(0.1)
    assert not forwarded(upstream, 1)


def test_order_short_ones_pass_a_young_head_but_not_one_that_waited_its_turn(make_guard, upstream):
    guard = make_guard(queue_s=3.0)  # a later one may pass the head for its first 0.75 s
    upstream.hold = threading.Event()
    running = Call(guard.url, ids(600, tag=1))  # holds 600 of 1000
    guard.wait_for(lambda: guard.tracker.in_prefill_tokens == 600)
    head = Call(guard.url, ids(900, tag=2))  # fits the rank, not beside the 600: waits
    guard.wait_for(lambda: guard.sample(DEPTH) == 1)
    queued_at = time.monotonic()
    short = Call(guard.url, ids(100, tag=3))  # fits now: passes the young head
    guard.wait_for(lambda: forwarded(upstream, 3))
    past_pass_s(guard, queued_at)
    late = Call(guard.url, ids(200, tag=4))  # fits now, but the head has waited its turn: it goes behind
    guard.wait_for(lambda: guard.sample(DEPTH) == 2)
    time.sleep(0.1)
    assert not forwarded(upstream, 4) and not forwarded(upstream, 2)
    upstream.hold.set()  # the holds drain: the head first, then the late one (not both at once: 900 + 200)
    for call in (running, short, head, late):
        assert call.outcome()[0] == 200
    order = [json.loads(body)["prompt"][0] for _m, path, body in upstream.seen if path == "/v1/completions"]
    assert order == [1, 3, 2, 4]  # the head was not starved
    assert guard.sample(OUTCOMES, {"outcome": "admitted"}) == 2


def test_order_a_queued_short_one_does_not_pass_a_head_that_waited_its_turn(make_guard, upstream):
    guard = make_guard(queue_s=3.0)
    upstream.hold = threading.Event()
    running = Call(guard.url, ids(600, tag=1))  # holds 600 of 1000
    guard.wait_for(lambda: guard.tracker.in_prefill_tokens == 600)
    head = Call(guard.url, ids(800, tag=2))  # fits the rank alone: waits for the holds to drain
    guard.wait_for(lambda: guard.sample(DEPTH) == 1)
    queued_at = time.monotonic()
    short = Call(guard.url, ids(500, tag=3))  # not beside the 600 either: waits behind the head
    guard.wait_for(lambda: guard.sample(DEPTH) == 2)
    past_pass_s(guard, queued_at)
    STATE["limit"] = 1150  # room for the short one (550), not the head; the head has waited its turn
    guard.wait_for(lambda: guard.tracker.published.rank_tokens == 1150)
    time.sleep(0.15)
    assert not forwarded(upstream, 3) and guard.sample(DEPTH) == 2
    upstream.hold.set()
    for call in (running, head, short):
        assert call.outcome()[0] == 200
    order = [json.loads(body)["prompt"][0] for _m, path, body in upstream.seen if path == "/v1/completions"]
    assert order == [1, 2, 3]


def test_a_head_that_would_not_fit_even_at_rest_blocks_nobody(make_guard, upstream):
    guard = make_guard(queue_s=3.0)
    head = Call(guard.url, ids(1500, tag=1))  # over the rank's 1000 even with nothing in prefill
    guard.wait_for(lambda: guard.sample(DEPTH) == 1)
    past_pass_s(guard, time.monotonic())
    status, _h, _d = request(guard.url, "POST", "/v1/completions", ids(100, tag=2))
    assert status == 200 and head.result is None  # draining the holds cannot make the head fit: no one waits on it
    STATE["limit"] = 1500
    assert head.outcome()[0] == 200


def test_a_waiter_is_admitted_when_the_guard_goes_blind_with_when_blind_admit(make_guard, upstream, hook):
    guard = make_guard(queue_s=5.0, stale_s=0.3)
    STATE["limit"] = 500
    guard.wait_for(lambda: guard.tracker.published.rank_tokens == 500)
    call = Call(guard.url, ids(800))
    guard.wait_for(lambda: guard.sample(DEPTH) == 1)
    hook.down = True  # blind after --stale-s: a newcomer would be admitted unchecked, so is the waiter
    status, _h, _d = call.outcome()
    assert status == 200 and call.answered_at - call.started < 2.0
    assert guard.sample("memtel_guard_admitted_total", {"path": "/v1/completions", "counted_by": "blind"}) == 1


def test_a_permanent_refusal_never_queues(make_guard, upstream):
    guard = make_guard(queue_s=5.0)
    upstream.max_model_len = 2000
    started = time.monotonic()
    status, headers, data = request(guard.url, "POST", "/v1/completions", ids(3000))
    assert status == 400 and time.monotonic() - started < 1.0 and headers["x-should-retry"] == "false"
    assert json.loads(data)["error"]["code"] == "context_length_exceeded"
    assert all(guard.sample(OUTCOMES, {"outcome": o}) == 0
               for o in ("admitted", "timed_out", "client_left", "queue_full", "refused"))
    assert guard.sample("memtel_guard_queue_wait_seconds_count") == 0
