"""The guard's connection server: keep-alive, the connection cap and eviction, the listen backlog."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import struct
import threading
import time

import pytest

from telemetry.admission.prompt import COMPLETIONS
from telemetry.catalogue.fields import GUARD_NOT_FORWARDED
from telemetry.guard.proxy import GuardLimits
from tests.guard.servers import RunningGuard, StubHook, exposition, make_proxy, request


@pytest.fixture(scope="module")
def guard(upstream):
    hook = StubHook(lambda: exposition(1000))
    running = RunningGuard(upstream.url, [hook.url])
    running.wait_for(lambda: running.tracker.published is not None)
    yield running
    running.stop()
    hook.stop()


def read_answer(stream) -> tuple[int, str, bytes]:
    response = http.client.HTTPResponse(_OneStream(stream))  # type: ignore[arg-type]
    response.begin()
    return response.status, (response.getheader("Connection") or "").lower(), response.read()


class _OneStream:
    """Hands http.client the one buffered reader of the socket, so each answer is read from where the last ended."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def makefile(self, *_args):
        return self

    def close(self) -> None:
        pass

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def test_requests_one_after_another_are_served_on_one_connection(guard, upstream):
    upstream.seen.clear()
    with socket.create_connection(("127.0.0.1", guard.port), timeout=5) as sock:
        stream = sock.makefile("rb")
        for n in range(3):
            body = json.dumps({"prompt": f"hello {n}", "max_tokens": 1}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: guard\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            status, connection, data = read_answer(stream)
            assert (status, connection) == (200, ""), f"request {n + 1} on the connection"
            assert json.loads(data)["choices"]
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: guard\r\n\r\n")  # a forwarded path, on the same socket
        status, connection, _ = read_answer(stream)
        assert (status, connection) == (200, "")
    assert [path for _, path, _ in upstream.seen].count("/v1/completions") == 3


NOWHERE = "http://127.0.0.1:1"   # a hook no one answers: the guard stays blind and admits (--when-blind admit)


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


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def test_past_the_connection_cap_with_every_request_in_hand_a_newcomer_gets_503_and_close(start_guard, upstream):
    guard = start_guard([NOWHERE], ready=lambda g: True, limits=GuardLimits(max_connections=1))
    upstream.seen.clear()   # (the module's earlier tests' completions)
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


def test_pipelined_requests_never_read_leave_the_guard_serving_others_promptly(guard):
    # Issue 41: 300 connections sending 3,000 pipelined GET /nope each and never reading locked the guard: the
    # buffered requests were served without a yield to the event loop. Fewer connections, the same effect.
    flood = b"GET /nope HTTP/1.1\r\nHost: g\r\n\r\n" * 3000
    floods = [socket.create_connection(("127.0.0.1", guard.port)) for _ in range(12)]
    try:
        for sock in floods:
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.send(flood)
        waits = []
        for _ in range(5):
            started = time.perf_counter()
            status, _headers, _body = request(guard.url, "GET", "/health")
            waits.append(time.perf_counter() - started)
            assert status == 200
        assert max(waits) < 0.5, waits   # served beside the floods (1.9 s for the first here, before the yields)
    finally:
        for sock in floods:
            sock.close()


def test_a_client_that_pipelines_without_end_is_closed_after_max_pipelined_answers(guard):
    with socket.create_connection(("127.0.0.1", guard.port), timeout=10) as sock:
        sock.sendall(b"GET /nope HTTP/1.1\r\nHost: g\r\n\r\n" * 300)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert received.count(b"HTTP/1.1 404 ") == GuardLimits().max_pipelined == 100
