"""Teeth for the guard's last mutation survivors (issue 30; docs/testing.md, "Mutation testing"): the connection
cap's 503 and which waiting connection is evicted for a newcomer, a path refused and counted, the blind refusal's
wording and count, the queue's room spent per waiter, a waiter whose new count proves it over the at-best limit, a
request waiting for a replica to come back, the lingering close that drains until EOF, a read with no time left, an
upstream that closes before answering, the latency histogram and the collector's description, the listen backlog,
and `memtel guard`'s scrape timeout floor and its log line without --metrics-listen. In-process; the socket tests
use real loopback connections to a guard in this process."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import re
import signal
import socket
import struct
import threading

import h11
import pytest
from prometheus_client import CollectorRegistry

from telemetry.catalogue import metrics as catalogue
from telemetry.catalogue.fields import GUARD_NOT_FORWARDED
from telemetry.guard import cli
from telemetry.guard.http import Channel, ClientSide, ServerSide, UpstreamClosed, UpstreamError
from telemetry.guard.limit import LimitTracker
from telemetry.guard.metrics import ADDED_LATENCY_BUCKETS, GuardCollector, GuardMetrics
from telemetry.guard.prompt import COMPLETIONS
from telemetry.guard.proxy import GuardLimits, GuardProxy, _body_error
from telemetry.url import parse_base_url, parse_url

NOWHERE = "http://127.0.0.1:1"   # a hook no one answers: the guard stays blind and admits (--when-blind admit)


def make_proxy(replicas: int = 1, **options) -> GuardProxy:
    engines = [(parse_base_url(f"http://127.0.0.1:{10 + i}"), LimitTracker([parse_url(f"http://127.0.0.1:{20 + i}")],
                                                                           stale_s=5)) for i in range(replicas)]
    return GuardProxy(*engines[0], GuardMetrics(), replicas=engines, **options)


# -- what the guard says ----------------------------------------------------------------------------------
def test_a_body_error_quotes_the_parsers_first_160_characters():
    assert _body_error(ValueError("x" * 300 + "\nmore")) == \
        f"malformed JSON in the request body: {'x' * 160}; expected a JSON object"


def test_why_blind_names_each_replica_only_when_there_are_several():
    one = make_proxy()
    assert one._why_blind() == "http://127.0.0.1:20/metrics: no answer yet"
    two = make_proxy(2)
    assert two._why_blind() == ("http://127.0.0.1:10: http://127.0.0.1:20/metrics: no answer yet; "
                                "http://127.0.0.1:11: http://127.0.0.1:21/metrics: no answer yet")


def test_the_added_latency_histogram_counts_each_observation_in_its_bucket():
    metrics = GuardMetrics()
    metrics.observe_added(0.0003)
    metrics.observe_added(7.0)
    buckets, total = metrics.latency()
    assert len(buckets) == len(ADDED_LATENCY_BUCKETS) + 1
    assert buckets[ADDED_LATENCY_BUCKETS.index(0.0005)] == 1 and buckets[-1] == 1 and sum(buckets) == 2
    assert total == pytest.approx(7.0003)


def test_the_collector_describes_every_family_it_collects_so_a_registry_takes_it_once():
    proxy = make_proxy(2)
    collector = GuardCollector(proxy.metrics, proxy.tracker, proxy.replicas)
    described = {m.name for m in collector.describe()}
    assert {m.name for m in collector.collect()} <= described
    assert catalogue.GUARD_REPLICA_IN_POOL.new().name in described   # several replicas' families too
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.register(GuardCollector(proxy.metrics, proxy.tracker, proxy.replicas))


# -- HTTP -------------------------------------------------------------------------------------------------
def test_the_lingering_close_drains_what_the_client_sends_until_its_eof():
    channel = Channel()
    fed = []

    def feed(data: bytes | None) -> None:
        fed.append(data)
        channel.eof_received() if data is None else channel.data_received(data)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        feed(b"rest of a body")
        loop.call_later(0.01, feed, b"and more")
        loop.call_later(0.02, feed, None)
        await channel.discard(1 << 20, 2.0)

    asyncio.run(main())
    assert fed == [b"rest of a body", b"and more", None]   # it returned at the EOF, not at the first bytes


def test_a_request_read_with_no_time_left_is_a_timeout_even_with_bytes_waiting():
    channel = Channel()
    channel.data_received(b"POST /v1/completions HTTP/1.1\r\n")

    async def main() -> bytes:
        with pytest.raises(asyncio.TimeoutError):
            await ServerSide(channel, 16384)._read(0.0)
        return await channel.read(None)

    assert asyncio.run(main()) == b"POST /v1/completions HTTP/1.1\r\n"   # still unread


def upstream_answer(data: bytes) -> Exception:
    """What ClientSide.response raises when the upstream, sent a GET, answers `data` (maybe nothing) and closes."""
    channel = Channel()

    async def main() -> None:
        side = ClientSide(channel, 16384)
        side._frame(h11.Request(method="GET", target="/", headers=[("Host", "u")]), h11.EndOfMessage())  # sent
        if data:
            channel.data_received(data)
        channel.eof_received()
        await side.response(1.0)

    with pytest.raises(UpstreamError) as raised:
        asyncio.run(main())
    return raised.value


def test_an_upstream_that_closes_before_a_byte_is_closed_and_one_that_sends_garbage_is_malformed():
    closed = upstream_answer(b"")
    assert type(closed) is UpstreamClosed and str(closed) == "the connection closed without an answer"
    garbage = upstream_answer(b"NOT HTTP AT ALL\r\n\r\n")
    assert type(garbage) is UpstreamError and str(garbage).startswith("malformed answer: ")


# -- listening, and the command -----------------------------------------------------------------------------
def test_the_guard_listens_with_a_backlog_of_1024():
    async def main() -> int:
        proxy = make_proxy()
        await proxy.start("127.0.0.1", 0)
        assert proxy._server is not None
        try:
            info = proxy._server.sockets[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        finally:
            await proxy.stop()
        return struct.unpack_from("I", info, 28)[0]   # tcpi_sacked: a listening socket's backlog (Linux)

    with open("/proc/sys/net/core/somaxconn") as somaxconn:
        assert asyncio.run(main()) == min(1024, int(somaxconn.read()))


def test_the_command_scrapes_with_a_timeout_of_at_least_0_2_s_and_logs_metrics_not_served(monkeypatch, caplog):
    seen = []

    async def scrape(tracker, poll_s, timeout_s):
        seen.append((tracker, poll_s, timeout_s))
        signal.raise_signal(signal.SIGTERM)   # the command's own stop: asyncio's handler is installed by now
        await asyncio.Event().wait()

    monkeypatch.setattr(cli, "scrape_forever", scrape)
    caplog.set_level(logging.INFO, logger="memtel.guard")
    proxy = make_proxy()
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert asyncio.run(cli._serve(proxy, "127.0.0.1", 0, None, 0.1)) == 0
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)   # asyncio leaves the default behind
    assert seen == [(proxy.tracker, pytest.approx(0.1 / 3), 0.2)]   # stale_s / 2 is 0.05: the floor
    lines = [r.getMessage() for r in caplog.records if r.name == "memtel.guard"]
    assert re.fullmatch(r"memtel guard on http://127\.0\.0\.1:\d+ in front of http://127\.0\.0\.1:10, reading 1 "
                        r"hook\(s\); metrics not served", lines[0]), lines
    assert lines[-1] == "memtel guard stopped"


# -- the connection cap, through real sockets ---------------------------------------------------------------
def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def test_past_the_connection_cap_with_every_request_in_hand_a_newcomer_gets_503_and_close(start_guard, upstream):
    guard = start_guard([NOWHERE], ready=lambda g: True, limits=GuardLimits(max_connections=1))
    upstream.hold = threading.Event()
    body = json.dumps({"prompt": "one two"}).encode()
    try:
        with socket.create_connection(("127.0.0.1", guard.port), timeout=5) as held:
            held.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            guard.wait_for(lambda: COMPLETIONS in upstream.paths())   # read whole: not waiting, not evicted
            with socket.create_connection(("127.0.0.1", guard.port), timeout=5) as late:
                answer = read_all(late)   # the guard closes it after the answer
            upstream.hold.set()
            assert held.recv(4096).startswith(b"HTTP/1.1 200 ")
    finally:
        upstream.hold.set()
        upstream.hold = None
    head, _, text = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 503 Service Unavailable"
    assert sorted(lines[1:]) == ["Connection: close", "Content-Length: 35", "Content-Type: text/plain"]
    assert text == b"memtel guard: too many connections\n"
    assert guard.sample("memtel_guard_connections_closed_total", {"how": "refused"}) == 1
    assert guard.sample("memtel_guard_connections_closed_total", {"how": "evicted"}) == 0


def test_a_newcomer_past_the_cap_evicts_the_connection_waiting_longest(start_guard):
    guard = start_guard([NOWHERE], ready=lambda g: True, limits=GuardLimits(max_connections=3))
    first = http.client.HTTPConnection("127.0.0.1", guard.port, timeout=5)
    socks = []
    try:
        first.connect()
        for n in (2, 3):
            socks.append(socket.create_connection(("127.0.0.1", guard.port), timeout=5))
            guard.wait_for(lambda n=n: guard.proxy.open_connections == n)
        # The first one asks for a path the guard does not forward: answered 404 on the connection kept alive,
        # it waits for its next request from now on, so the second is the one waiting longest.
        first.request("POST", "/v1/embeddings", body=b"{}")
        answer = first.getresponse()
        error = json.loads(answer.read())["error"]
        assert (answer.status, error["type"], error["code"]) == (404, GUARD_NOT_FORWARDED, 404)
        assert guard.sample("memtel_guard_rejected_total", {"reason": "not_forwarded"}) == 1
        for evicted in (socks[0], socks[1]):   # each newcomer evicts the one waiting longest then
            socks.append(socket.create_connection(("127.0.0.1", guard.port), timeout=5))
            assert evicted.recv(1) == b""
        for kept in (first.sock, *socks[2:]):
            kept.setblocking(False)
            with pytest.raises(BlockingIOError):
                kept.recv(1)
        assert guard.sample("memtel_guard_connections_closed_total", {"how": "evicted"}) == 2
        assert guard.sample("memtel_guard_connections_closed_total", {"how": "refused"}) == 0
    finally:
        first.close()
        for sock in socks:
            sock.close()

