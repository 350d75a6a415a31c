"""The guard keeps a client's connection open between requests (HTTP/1.1 keep-alive).

One raw socket, requests sent one after another (each only after the answer to the one before, so it is not
pipelining): every one must be answered on that socket. http.client would open a new connection when the guard
says `Connection: close`, which is why tests/guard/test_proxy.py's keep-alive test passed with keep-alive
removed (issue 30); a raw socket cannot.
"""

from __future__ import annotations

import http.client
import json
import socket

import pytest

from tests.guard.servers import RunningGuard, StubHook, exposition


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
