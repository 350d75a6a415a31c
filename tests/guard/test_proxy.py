"""The guard in front of a real loopback upstream, reading a real loopback hook exporter."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
import time

import pytest

from telemetry.guard.proxy import GuardLimits, _body_error
from tests.guard.servers import RunningGuard, StubHook, exposition, make_proxy, request

LIMIT = 1000


@pytest.fixture(scope="module")
def hook():
    server = StubHook(lambda: exposition(LIMIT, node="node-a", rank="1", budget=4e9, growth={4000: 6.5e9}))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def guard(upstream, hook):
    running = RunningGuard(upstream.url, [hook.url], limits=GuardLimits(max_body_bytes=1 << 20, queue_s=0.0))
    running.wait_for(lambda: running.tracker.published is not None)
    yield running
    running.stop()


@pytest.fixture(autouse=True)
def _clean(upstream, hook):
    upstream.seen.clear()
    upstream.tokens_per_word = 1
    upstream.gate = upstream.hold = None
    hook.down = False
    yield
    if upstream.gate is not None:
        upstream.gate.set()
    if upstream.hold is not None:
        upstream.hold.set()


def test_a_prompt_within_the_byte_bound_is_forwarded_unchanged_without_tokenize(guard, upstream):
    body = {"model": "stub", "prompt": "word " * 20, "max_tokens": 4}   # under an eighth of the 1,000-token limit
    direct = request(upstream.url, "POST", "/v1/completions", body)
    upstream.seen.clear()
    status, headers, data = request(guard.url, "POST", "/v1/completions", body)
    assert status == 200 and data == direct[2]
    assert headers["x-upstream"] == "stub"
    assert upstream.seen == [("POST", "/v1/completions", json.dumps(body).encode())]
    assert guard.sample("memtel_guard_admitted_total", {"path": "/v1/completions", "counted_by": "byte_bound"}) >= 1


def test_a_prompt_over_the_byte_bound_is_counted_by_the_upstream_and_forwarded_when_it_fits(guard, upstream):
    body = {"prompt": "longerword " * 200, "max_tokens": 4}  # 2,200 bytes > 1,000, 200 tokens
    status, _, _ = request(guard.url, "POST", "/v1/completions", body)
    assert status == 200
    assert upstream.paths() == ["/tokenize", "/v1/completions"]
    assert json.loads(upstream.seen[0][2]) == {"prompt": body["prompt"]}


def test_a_prompt_with_more_words_than_the_limit_is_refused_at_once_and_never_forwarded(guard, upstream):
    started = time.perf_counter()
    status, headers, data = request(guard.url, "POST", "/v1/completions", {"prompt": "w " * 5000})
    elapsed = time.perf_counter() - started
    assert status == 503 and elapsed < 0.5
    assert upstream.paths() in ([], ["/v1/models"])  # not even /tokenize: only max-model-len, read once a minute
    assert headers["retry-after"] == "10" and headers["x-should-retry"] == "true"
    error = json.loads(data)["error"]
    assert error["type"] == "memtel_would_not_fit" and error["code"] == 503
    assert error["reason"] == "would_not_fit"
    assert (error["prompt_tokens"], error["prompt_tokens_counted_by"]) == (5000, "words")
    assert (error["limit_tokens"], error["max_prefill_tokens"], error["in_prefill_tokens"]) == (LIMIT, LIMIT, 0)
    assert (error["node"], error["rank"]) == ("node-a", "1")
    assert error["fit_budget_bytes"] == 4_000_000_000
    assert (error["forecast_tokens"], error["forecast_bytes"]) == (None, None)  # the hook forecasts 4,000 only
    assert "at least 5,000 tokens" in error["message"] and "\n" not in error["message"]


def test_a_prompt_the_upstream_counts_over_the_limit_is_refused_with_its_own_forecast(guard, upstream):
    upstream.tokens_per_word = 6
    status, _, data = request(guard.url, "POST", "/v1/completions", {"prompt": "token " * 600})
    assert status == 503
    assert upstream.paths() == ["/tokenize"]
    error = json.loads(data)["error"]
    assert (error["prompt_tokens"], error["prompt_tokens_counted_by"]) == (3600, "tokenize")
    # The prompt's own length, on the line from 0 to the hook's 4,000-token forecast (not the 4,000's figure).
    assert (error["forecast_tokens"], error["forecast_bytes"], error["forecast_from_tokens"]) == \
        (3600, 5_850_000_000, [4000])
    assert "a prefill of 3,600 tokens" in error["forecast"] and "4,000 tokens)" in error["forecast"]


def test_token_ids_are_counted_exactly(guard, upstream):
    assert request(guard.url, "POST", "/v1/completions", {"prompt": [1] * LIMIT})[0] == 200
    status, _, data = request(guard.url, "POST", "/v1/completions", {"prompt": [1] * (LIMIT + 1)})
    assert status == 503 and json.loads(data)["error"]["prompt_tokens_counted_by"] == "token_ids"
    assert upstream.paths() == ["/v1/completions"]


def test_chat_is_counted_by_the_upstream_with_the_template_allowance(guard, upstream):
    # 20 bytes of content is far below 1,000 tokens, but the template allowance (2,048) is not.
    body = {"messages": [{"role": "user", "content": "hello there, stub"}], "max_tokens": 2}
    assert request(guard.url, "POST", "/v1/chat/completions", body)[0] == 200
    assert upstream.paths() == ["/tokenize", "/v1/chat/completions"]
    tokenize = json.loads(upstream.seen[0][2])
    assert tokenize["messages"] == body["messages"] and tokenize["add_generation_prompt"] is True


def test_a_stream_reaches_the_client_chunk_by_chunk_and_byte_for_byte(guard, upstream):
    body = {"prompt": "word " * 10, "stream": True}
    direct = request(upstream.url, "POST", "/v1/completions", body)[2]
    upstream.gate = threading.Event()
    conn = http.client.HTTPConnection("127.0.0.1", guard.port, timeout=10)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
        first = response.read1(65536)  # arrives while the upstream still holds the rest back
        assert first.startswith(b"data: ") and b"alpha" in first and b"[DONE]" not in first
        upstream.gate.set()
        rest = response.read()
    finally:
        conn.close()
    assert first + rest == direct


def test_other_paths_pass_through_and_upstream_errors_come_back_unchanged(guard, upstream):
    for method, path, body in (("GET", "/v1/models", None), ("GET", "/health", None),
                               ("POST", "/tokenize", {"prompt": "a b c"}),
                               ("POST", "/v1/completions", {"prompt": "x", "temperature": -1})):
        direct = request(upstream.url, method, path, body)
        via = request(guard.url, method, path, body)
        assert (via[0], via[2]) == (direct[0], direct[2]), path
        assert via[1].get("content-type") == direct[1].get("content-type")


@pytest.mark.parametrize(("path", "raw", "status", "words"), [
    ("/v1/completions", b'{"prompt": "abc"', 400, "malformed JSON"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "not UTF-8"),
    ("/v1/completions", b"[1, 2]", 400, "must be a JSON object"),
    ("/v1/completions", b'{"max_tokens": 3}', 400, "`prompt` is missing"),
    ("/v1/chat/completions", b'{"prompt": "hello"}', 400, "`messages` is missing"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 7}]}', 400, "content must be"),
    ("/v1/completions", b'{"prompt": "' + b"a" * (1 << 20) + b'"}', 413, "larger than the guard's limit"),
    ("/v1/embeddings", b'{"input": "hello"}', 404, "is not forwarded"),
    ("/generate", b'{"text": "hello"}', 404, "is not forwarded"),
])
def test_bad_input_is_answered_here_in_one_line_and_not_forwarded(guard, upstream, path, raw, status, words):
    got, _, data = request(guard.url, "POST", path, raw=raw)
    assert got == status
    message = json.loads(data)["error"]["message"]
    assert words in message and "\n" not in message
    assert upstream.seen == []


def test_a_get_on_a_completion_path_is_refused(guard, upstream):
    status, _, _ = request(guard.url, "GET", "/v1/completions")
    assert status == 405 and upstream.seen == []


def test_a_malformed_request_head_is_a_400(guard, upstream):
    with socket.create_connection(("127.0.0.1", guard.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nBad Header\r\n\r\n")
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 400 ") and upstream.seen == []


def test_an_admitted_prefill_holds_its_tokens_until_the_upstream_answers(guard, upstream):
    upstream.hold = threading.Event()
    first: list = []
    body = {"prompt": [7] * 600}  # 600 tokens: fits alone (1,000), not twice
    thread = threading.Thread(target=lambda: first.append(request(guard.url, "POST", "/v1/completions", body)))
    thread.start()
    try:
        guard.wait_for(lambda: guard.tracker.in_prefill_tokens == 600)
        status, headers, data = request(guard.url, "POST", "/v1/completions", body)
        error = json.loads(data)["error"]
        assert status == 503 and headers["retry-after"] == "1"
        assert (error["reason"], error["in_prefill_tokens"], error["limit_tokens"]) == ("in_prefill", 600, 400)
    finally:
        upstream.hold.set()
        thread.join(10)
    assert first[0][0] == 200
    guard.wait_for(lambda: guard.tracker.in_prefill_tokens == 0)
    assert request(guard.url, "POST", "/v1/completions", body)[0] == 200


def test_keep_alive_connections_serve_many_requests(guard, upstream):
    conn = http.client.HTTPConnection("127.0.0.1", guard.port, timeout=10)
    try:
        for _ in range(3):
            conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "hi"}))
            response = conn.getresponse()
            assert response.status == 200 and response.read()
            conn.request("POST", "/v1/completions", body=b"{")
            response = conn.getresponse()
            assert response.status == 400 and response.read()
    finally:
        conn.close()


def test_an_upstream_that_is_down_is_a_502(hook):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    running = RunningGuard(f"http://127.0.0.1:{port}", [hook.url])
    try:
        status, _, data = request(running.url, "POST", "/v1/completions", {"prompt": "hi"})
        assert status == 502 and json.loads(data)["error"]["type"] == "memtel_upstream_unavailable"
        assert running.sample("memtel_guard_upstream_failures_total", {"stage": "connect"}) == 1
    finally:
        running.stop()


@pytest.mark.parametrize("when_blind", ["admit", "reject"])
def test_blind_mode_then_the_limit_again(upstream, when_blind, caplog):
    hook = StubHook(lambda: exposition(LIMIT))
    # stale after 1 s: a busy 2-core machine can pause one poll for a few tenths of a second
    running = RunningGuard(upstream.url, [hook.url], when_blind=when_blind, stale_s=1.0, poll_s=0.05)
    small, big = {"prompt": "w " * 10}, {"prompt": "w " * 5000}
    try:
        running.wait_for(lambda: running.tracker.published is not None)
        assert request(running.url, "POST", "/v1/completions", big)[0] == 503
        with caplog.at_level(logging.WARNING, logger="memtel.guard"):
            hook.down = True
            running.wait_for(lambda: running.tracker.blind)
            time.sleep(0.2)  # several scrapes inside one episode: still one log line
            upstream.seen.clear()
            status, headers, data = request(running.url, "POST", "/v1/completions", big)
            if when_blind == "admit":
                assert status == 200 and upstream.paths() == ["/v1/completions"]
            else:
                error = json.loads(data)["error"]
                assert status == 503 and error["type"] == "memtel_guard_blind" and headers["retry-after"] == "5"
                assert upstream.seen == [] and hook.url in error["hooks"][0]
            assert running.sample("memtel_guard_blind") == 1
            assert running.sample("memtel_guard_blind_decisions_total", {"decision": when_blind}) == 1
            # /health: passed through when admitting, 503 when refusing everything
            assert request(running.url, "GET", "/health")[0] == (200 if when_blind == "admit" else 503)
            hook.down = False
            running.wait_for(lambda: not running.tracker.blind)
        blind_lines = [r for r in caplog.records if "is blind" in r.getMessage()]
        assert len(blind_lines) == 1 and "503" in blind_lines[0].getMessage()
        assert running.sample("memtel_guard_blind_episodes_total") == 1
        assert running.sample("memtel_guard_blind_seconds_total") > 0.1
        assert running.sample("memtel_guard_limit_tokens") == LIMIT
        assert request(running.url, "POST", "/v1/completions", big)[0] == 503
        assert request(running.url, "POST", "/v1/completions", small)[0] == 200
        assert request(running.url, "GET", "/health")[0] == 200
    finally:
        running.stop()
        hook.stop()


def test_a_stale_forecast_is_not_used(upstream):
    hook = StubHook(lambda: exposition(LIMIT, forecast_time=time.time() - 60))
    running = RunningGuard(upstream.url, [hook.url], stale_s=5.0)
    try:
        running.wait_for(lambda: hook.scrapes >= 2 and running.tracker.blind is True)
        assert running.sample("memtel_guard_fresh_ranks") == 0
    finally:
        running.stop()
        hook.stop()


def test_the_smallest_fresh_rank_sets_the_limit(upstream):
    hooks = [StubHook(lambda: exposition(5000, rank="0", node="spark-1")),
             StubHook(lambda: exposition(700, rank="1", node="spark-2"))]
    running = RunningGuard(upstream.url, [h.url for h in hooks])
    try:
        running.wait_for(lambda: running.tracker.published_fresh == 2)
        status, _, data = request(running.url, "POST", "/v1/completions", {"prompt": "w " * 800})
        error = json.loads(data)["error"]
        assert status == 503 and (error["node"], error["rank"], error["limit_tokens"]) == ("spark-2", "1", 700)
        assert running.sample("memtel_guard_max_prefill_tokens", {"node": "spark-2", "rank": "1"}) == 700
        hooks[1].down = True  # one rank of two unseen: the other one's limit, not blind
        running.wait_for(lambda: running.tracker.published_fresh == 1, timeout=6)
        assert running.sample("memtel_guard_limit_tokens") == 5000
    finally:
        running.stop()
        for h in hooks:
            h.stop()


def test_a_head_over_16_kib_is_a_431_and_not_forwarded(guard, upstream):
    with socket.create_connection(("127.0.0.1", guard.port), timeout=5) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n")
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 431 ") and upstream.seen == []


def test_a_client_that_does_not_read_holds_the_upstream_back(guard, upstream):
    """Backpressure: the guard reads the upstream's stream only as fast as the client takes it."""
    upstream.streamed_bytes = 0
    total = 512 * 65536  # 32 MiB
    conn = http.client.HTTPConnection("127.0.0.1", guard.port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "hi", "stream": True, "big_chunks": 512}))
        response = conn.getresponse()
        assert response.status == 200
        # The client reads nothing: the upstream writes until the buffers on the way are full, then stalls.
        deadline, before = time.monotonic() + 10, -1
        while upstream.streamed_bytes != before and time.monotonic() < deadline:
            before = upstream.streamed_bytes
            time.sleep(0.25)
        assert before == upstream.streamed_bytes < total / 2, (before, upstream.streamed_bytes)
        received = len(response.read())
    finally:
        conn.close()
    assert received == total and upstream.streamed_bytes == total


def test_a_kept_alive_upstream_connection_the_upstream_closed_is_retried_once(guard, upstream):
    assert request(guard.url, "POST", "/v1/completions", {"prompt": "one"})[0] == 200
    upstream.close_connections()  # the guard still holds that connection in its pool
    assert request(guard.url, "POST", "/v1/completions", {"prompt": "two"})[0] == 200
    assert [json.loads(body)["prompt"] for _m, _p, body in upstream.seen] == ["one", "two"]


def test_a_body_over_the_inline_size_is_parsed_off_the_loop_with_the_same_answer(guard, upstream, monkeypatch):
    import telemetry.guard.proxy as proxy

    monkeypatch.setattr(proxy, "INLINE_PARSE_BYTES", 1000)
    status, _, data = request(guard.url, "POST", "/v1/completions", {"prompt": "w " * 5000})
    assert status == 503 and json.loads(data)["error"]["prompt_tokens"] == 5000
    assert request(guard.url, "POST", "/v1/completions", raw=b'{"prompt": "' + b"a" * 2000)[0] == 400
    assert request(guard.url, "POST", "/v1/completions", {"prompt": "word " * 300})[0] == 200  # via /tokenize


def _where_measured(monkeypatch) -> list[str]:
    """Where the guard sizes each body from now on ("loop": on the event loop, "thread": in a worker)."""
    import telemetry.guard.proxy as proxy

    where: list[str] = []
    sized = proxy.measure

    def measure(path, body):
        try:
            asyncio.get_running_loop()
            where.append("loop")
        except RuntimeError:   # no event loop runs in this thread: a worker's
            where.append("thread")
        return sized(path, body)

    monkeypatch.setattr(proxy, "measure", measure)
    return where


def test_a_body_over_the_inline_size_is_parsed_in_a_worker_thread_and_a_smaller_one_on_the_loop(guard, monkeypatch):
    import telemetry.guard.proxy as proxy

    monkeypatch.setattr(proxy, "INLINE_PARSE_BYTES", 1000)
    where = _where_measured(monkeypatch)
    assert request(guard.url, "POST", "/v1/completions", {"prompt": "w " * 5000})[0] == 503
    assert request(guard.url, "POST", "/v1/completions", {"prompt": "w " * 10})[0] == 200
    assert where == ["thread", "loop"]


def test_a_responses_prompt_is_sized_and_guarded_like_chat(guard, upstream):
    # Within the limit: forwarded unchanged to /v1/responses (the template's allowance is counted by /tokenize).
    fits = {"model": "stub", "input": "word " * 50, "instructions": "be brief"}
    status, _, _ = request(guard.url, "POST", "/v1/responses", fits)
    assert status == 200 and upstream.paths()[-1] == "/v1/responses"
    assert guard.sample("memtel_guard_admitted_total", {"path": "/v1/responses", "counted_by": "tokenize"}) >= 1
    upstream.seen.clear()
    # More words than the limit in its input items: refused by the guard, never forwarded.
    over = {"model": "stub", "input": [{"role": "user", "content": [{"type": "input_text", "text": "w " * 5000}]}]}
    status, headers, data = request(guard.url, "POST", "/v1/responses", over)
    error = json.loads(data)["error"]
    assert status == 503 and headers["x-should-retry"] == "true"
    assert (error["prompt_tokens"], error["prompt_tokens_counted_by"]) == (5000, "words")
    assert "/v1/responses" not in upstream.paths()
    # A stored conversation the guard cannot count: a 400 naming the field, never forwarded.
    status, _, data = request(guard.url, "POST", "/v1/responses", {"model": "stub", "input": "hi",
                                                                  "previous_response_id": "resp_1"})
    assert status == 400 and "previous_response_id" in json.loads(data)["error"]["message"]
    assert "/v1/responses" not in upstream.paths()


def test_a_body_error_quotes_the_parsers_first_160_characters():
    assert _body_error(ValueError("x" * 300 + "\nmore")) == \
        f"malformed JSON in the request body: {'x' * 160}; expected a JSON object"


def test_why_blind_names_each_replica_only_when_there_are_several():
    one = make_proxy()
    assert one._why_blind() == "http://127.0.0.1:20/metrics: no answer yet"
    two = make_proxy(2)
    assert two._why_blind() == ("http://127.0.0.1:10: http://127.0.0.1:20/metrics: no answer yet; "
                                "http://127.0.0.1:11: http://127.0.0.1:21/metrics: no answer yet")


def test_a_hook_without_the_gauge_is_said_at_start_in_health_and_in_a_metric_naming_the_variable(start_guard, caplog):
    bare = StubHook("memtel_hook_calls_total 3\n")   # the hook answers; its engine runs without the forecast
    try:
        with caplog.at_level(logging.ERROR, logger="memtel.guard"):
            guard = start_guard([bare.url], ready=lambda g: g.sample("memtel_guard_hooks_without_gauge") == 1)
            guard.wait_for(lambda: bare.scrapes >= 3)
        said = [r.getMessage() for r in caplog.records if "exports no" in r.getMessage()]
        assert len(said) == 1 and "MEMTEL_FORECAST_TOKENS" in said[0] and bare.url in said[0]   # once, not per scrape
        status, headers, _ = request(guard.url, "GET", "/health")
        assert status == 200   # the engine's own answer: a load balancer keeps a serving engine
        assert "MEMTEL_FORECAST_TOKENS" in headers["x-memtel-guard-blind"]
        assert request(guard.url, "POST", "/v1/completions", {"prompt": "w " * 10})[0] == 200   # --when-blind admit
    finally:
        bare.stop()


def test_health_carries_no_blind_header_while_the_hooks_export_the_gauge(guard):
    status, headers, _ = request(guard.url, "GET", "/health")
    assert status == 200 and "x-memtel-guard-blind" not in headers
    assert guard.sample("memtel_guard_hooks_without_gauge") == 0


def test_a_body_of_many_small_messages_is_parsed_in_a_worker_thread_whatever_its_size(guard, monkeypatch):
    # Issue 41: 500,000 tiny chat messages (7.5 MB, under the inline size) stalled every other client 1.8 s.
    import telemetry.guard.proxy as proxy

    where = _where_measured(monkeypatch)
    many = {"messages": [{"role": "user", "content": "w"}] * (proxy.INLINE_PARSE_OBJECTS + 1)}
    assert request(guard.url, "POST", "/v1/chat/completions", many)[0] in (200, 503)
    assert request(guard.url, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "w"}]})[0] \
        == 200
    assert where == ["thread", "loop"]


def test_a_health_poll_that_fails_in_any_way_takes_its_replica_out_and_the_polls_go_on(monkeypatch):
    import telemetry.guard.proxy as proxy_module

    proxy = make_proxy(2)
    calls = 0

    async def fetch(target, timeout_s):
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise RuntimeError("not an OSError")
        return b""

    monkeypatch.setattr(proxy_module, "fetch_metrics", fetch)

    async def main() -> list[tuple[bool, str | None]]:
        poller = asyncio.ensure_future(proxy.watch_health(0.01, 1.0))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        out = [(r.healthy, r.health_error) for r in proxy.replicas]
        for _ in range(100):
            if calls >= 4:
                break
            await asyncio.sleep(0.01)
        assert not poller.done()   # the polls went on
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
        return out

    assert asyncio.run(main()) == [(False, "/health: RuntimeError: not an OSError")] * 2
    assert [r.healthy for r in proxy.replicas] == [True, True]   # back once /health answered


def test_a_tokenize_count_past_2_to_the_31_is_no_count(guard, upstream):
    # Issue 41: every reading bounded (tokens <= 2^31), the upstream's count as the hooks' gauges.
    upstream.tokens_per_word = 1 << 32
    status, _, data = request(guard.url, "POST", "/v1/completions", {"prompt": "word " * 300})
    assert status == 502 and "without a token count" in json.loads(data)["error"]["message"]
    assert "/v1/completions" not in upstream.paths()
