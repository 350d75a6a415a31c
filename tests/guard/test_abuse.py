"""The guard stays bounded under abuse (issue 27): slow bodies, a huge upstream chunk, large or nonsensical hook
answers, a body no parser takes. Real loopback sockets; the guard runs in this process."""

from __future__ import annotations

import http.client
import json
import logging
import math
import socket
import time

import pytest

from telemetry.guard.limit import LimitTracker, RankFit, parse_hook
from telemetry.guard.proxy import GuardLimits
from telemetry.url import parse_url
from tests.guard.servers import RunningGuard, StubHook, exposition, request

LIMIT = 1000


@pytest.fixture(scope="module")
def hook():
    server = StubHook(lambda: exposition(LIMIT))
    yield server
    server.stop()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_connections_that_send_a_head_and_one_body_byte_do_not_stop_legitimate_requests(upstream, hook):
    """The review's cheap denial: connections holding a request body open were never evicted (0 of 149 legitimate
    requests served). With 8 connections allowed, 8 such ones, 8 slow heads and 8 idle ones: every legitimate
    request is served, by evicting the connection that has waited longest."""
    running = RunningGuard(upstream.url, [hook.url], limits=GuardLimits(max_connections=8))
    attackers = []
    try:
        running.wait_for(lambda: running.tracker.published is not None)
        for kind in ("idle", "head", "body"):  # the body ones last: they hold the 8 places
            for _ in range(8):
                sock = socket.create_connection(("127.0.0.1", running.port), timeout=5)
                if kind == "body":
                    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
                elif kind == "head":
                    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                attackers.append(sock)
        running.wait_for(lambda: running.proxy.open_connections == 8)
        time.sleep(0.2)  # for the guard to read their heads: nothing outside it shows that they are in their bodies
        for i in range(10):
            status, _, data = request(running.url, "POST", "/v1/completions", {"prompt": f"legit {i}"})
            assert status == 200 and json.loads(data)["choices"]
        assert running.sample("memtel_guard_connections_closed_total", {"how": "evicted"}) >= 10
        assert running.sample("memtel_guard_connections_closed_total", {"how": "refused"}) == 0
    finally:
        for sock in attackers:
            sock.close()
        running.stop()


def test_a_body_that_stalls_is_answered_408_after_the_read_timeout(upstream, hook):
    running = RunningGuard(upstream.url, [hook.url], limits=GuardLimits(read_timeout_s=0.3))
    try:
        with socket.create_connection(("127.0.0.1", running.port), timeout=5) as sock:
            started = time.monotonic()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
            answer = sock.recv(4096)
            waited = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408 ") and b"did not arrive in time" in answer
        assert 0.25 < waited < 3
    finally:
        running.stop()


def test_a_400_mib_upstream_chunk_to_a_stalled_client_is_relayed_in_bounded_pieces(upstream, hook):
    """The review's memory blow-up: the guard read a whole upstream chunk at once (RSS 28 MB to 1.25 GB for a
    400 MiB chunk). The upstream declares one 400 MiB chunk and writes up to 96 MiB of it; the client reads
    nothing. The upstream must stall after what the sockets' buffers hold, and the guard's memory stay flat."""
    running = RunningGuard(upstream.url, [hook.url])
    upstream.streamed_bytes = 0
    try:
        running.wait_for(lambda: running.tracker.published is not None)
        rss_before = _rss_bytes()
        conn = http.client.HTTPConnection("127.0.0.1", running.port, timeout=30)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "hi", "huge_chunk": 96}))
            response = conn.getresponse()
            assert response.status == 200
            deadline, before = time.monotonic() + 15, -1
            while upstream.streamed_bytes != before and time.monotonic() < deadline:
                before = upstream.streamed_bytes
                time.sleep(0.3)
            assert before == upstream.streamed_bytes < 32 << 20, before
            assert _rss_bytes() - rss_before < 48 << 20
            assert len(response.read1(1 << 20)) > 0  # and it is a stream, not a buffer
        finally:
            conn.close()
    finally:
        running.stop()


def test_a_5000_digit_integer_is_a_400_in_the_engine_error_shape_without_a_traceback(upstream, hook, caplog):
    running = RunningGuard(upstream.url, [hook.url])
    try:
        running.wait_for(lambda: running.tracker.published is not None)
        upstream.seen.clear()
        with caplog.at_level(logging.WARNING, logger="memtel.guard"):
            for raw in (b'{"prompt": [1' + b"2" * 5000 + b"]}", b'{"prompt": "x", "n": ' + b"9" * 5000 + b"}"):
                status, _, data = request(running.url, "POST", "/v1/completions", raw=raw)
                error = json.loads(data)["error"]
                assert status == 400 and (error["code"], error["param"]) == (400, None)
                assert "digits" in error["message"] and "\n" not in error["message"]
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
        assert upstream.seen == [] or all(path == "/v1/models" for _m, path, _b in upstream.seen)
    finally:
        running.stop()


def test_a_hook_answer_over_4_mib_is_refused_and_parsing_stays_off_the_event_loop(upstream, monkeypatch):
    import telemetry.guard.limit as limit

    big = StubHook("# " + "x" * (5 << 20) + "\n" + exposition(LIMIT))
    running = RunningGuard(upstream.url, [big.url], stale_s=5.0)
    try:
        running.wait_for(lambda: running.tracker.hooks[0].failures > 0)
        assert "larger than 4194304 bytes" in running.tracker.why_blind()
    finally:
        running.stop()
        big.stop()

    def slow_parse(text: str) -> tuple[list[RankFit], list[str]]:
        time.sleep(0.5)  # a 30 MiB answer's parse, as the review measured it on the loop
        return parse_hook(text)

    monkeypatch.setattr(limit, "parse_hook", slow_parse)
    hook = StubHook(lambda: exposition(LIMIT))
    running = RunningGuard(upstream.url, [hook.url], stale_s=5.0, poll_s=0.01)
    try:
        running.wait_for(lambda: running.tracker.published is not None, timeout=10)
        worst = 0.0
        for _ in range(10):  # the scraper parses all the time; the loop must answer meanwhile
            started = time.perf_counter()
            assert request(running.url, "GET", "/health")[0] == 200
            worst = max(worst, time.perf_counter() - started)
        assert worst < 0.4, worst
    finally:
        running.stop()
        hook.stop()


@pytest.mark.parametrize(("series", "value", "words"), [
    ("memtel_forecast_max_prefill_tokens", "NaN", "memtel_forecast_max_prefill_tokens is nan"),
    ("memtel_forecast_max_prefill_tokens", "-5", "memtel_forecast_max_prefill_tokens is -5"),
    ("memtel_forecast_max_prefill_tokens", "+Inf", "memtel_forecast_max_prefill_tokens is inf"),
    ("memtel_forecast_fit_budget_bytes", "NaN", "memtel_forecast_fit_budget_bytes is nan"),
    ("memtel_forecast_fit_budget_bytes", "-1e9", "memtel_forecast_fit_budget_bytes is -1e+09"),
    ("memtel_forecast_last_success_timestamp_seconds", "NaN", "timestamp_seconds is nan"),
    ("memtel_forecast_last_success_timestamp_seconds", "-Inf", "timestamp_seconds is -inf"),
    ("memtel_forecast_last_success_timestamp_seconds", "0", "timestamp_seconds is 0"),
])
def test_nonsensical_gauges_leave_the_rank_out_with_a_reason(series, value, words):
    lines = [line if not line.startswith(series) else line.rsplit(" ", 1)[0] + " " + value
             for line in exposition(LIMIT, rank="3", node="n").splitlines()]
    fits, rejected = parse_hook("\n".join(lines) + "\n")
    assert fits == [] and len(rejected) == 1 and "rank 3 on node n" in rejected[0] and words in rejected[0]
    tracker = LimitTracker([parse_url("http://127.0.0.1:9")], stale_s=5)
    tracker.record(tracker.hooks[0], fits, None, rejected)
    assert tracker.limit() is None and words in tracker.why_blind()


def test_a_forecast_from_the_future_or_without_a_time_is_not_fresh():
    tracker = LimitTracker([parse_url("http://127.0.0.1:9")], stale_s=5)
    hook = tracker.hooks[0]
    tracker.record(hook, [RankFit("0", "a", 900, None, time.time() + 3600)], None)
    assert tracker.limit() is None and "in the future" in tracker.why_blind()
    tracker.record(hook, [RankFit("0", "a", 900, None, None)], None)
    assert tracker.limit() is None and "exports no memtel_forecast_last_success" in tracker.why_blind()
    tracker.record(hook, [RankFit("0", "a", 900, None, time.time() + 0.5)], None)  # clocks a little apart
    assert tracker.limit() is not None and tracker.limit().tokens == 900
    assert not math.isnan(tracker.limit().tokens)
