"""Request smuggling and desync through the guard (issue 27): each attack the hostile review ran, on real sockets.

The upstream stand-in is a stdlib server, which (like uvicorn and vLLM's) never reads a GET's body and so
would parse one as the next request: what must reach it is only what the guard sized.
"""

from __future__ import annotations

import json
import socket

import pytest

from telemetry.guard.proxy import GuardLimits
from tests.guard.servers import RunningGuard, StubHook, StubUpstream, exposition, raw_exchange, request

LIMIT = 1000
BIG = json.dumps({"prompt": "w " * 5000}).encode()  # 5,000 words: refused by the guard at once


@pytest.fixture(scope="module")
def guard(upstream):
    hook = StubHook(lambda: exposition(LIMIT))
    running = RunningGuard(upstream.url, [hook.url], limits=GuardLimits(max_body_bytes=1 << 20, queue_s=0.0))
    running.wait_for(lambda: running.tracker.published is not None)
    yield running
    running.stop()
    hook.stop()


@pytest.fixture(autouse=True)
def _clean(upstream):
    upstream.seen.clear()
    upstream.extra_answer = None


def _prompts(upstream: StubUpstream) -> list[bytes]:
    """The completion bodies the upstream received (a refusal may also read its /v1/models: not a prompt)."""
    return [body for _method, path, body in upstream.seen if path == "/v1/completions"]


def _post(body: bytes, path: str = "/v1/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"\r\n").encode() + body


def test_a_get_whose_body_is_a_second_request_is_refused_and_the_prompt_never_reaches_the_upstream(guard, upstream):
    """The review's first kill: an over-large prompt as the Content-Length body of `GET /v1/models`."""
    hidden = _post(BIG)
    attack = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: {len(hidden)}\r\n\r\n".encode() + hidden
    [(status, _, data)] = raw_exchange(guard.port, attack)
    assert status == 400 and "must not carry a body" in json.loads(data)["error"]["message"]
    assert upstream.seen == []


@pytest.mark.parametrize(("head", "words"), [
    # a bare LF inside a header value hiding a Transfer-Encoding (the review's second kill)
    (b"X-Note: a\nTransfer-Encoding: chunked\r\n", "bare LF or CR"),
    (b"X-Note: a\rTransfer-Encoding: chunked\r\n", "malformed request"),  # a lone CR: h11 refuses it
    (b"X-Note: a\r\n Transfer-Encoding: chunked\r\n", "obs-fold"),
    (b"Content-Length: 12\r\nTransfer-Encoding: chunked\r\n", "both Content-Length and Transfer-Encoding"),
    (b"Content-Length: 12\r\nContent-Length: 13\r\n", "conflicting Content-Length"),
    (b"Transfer-Encoding: gzip, chunked\r\n", "Transfer-Encoding"),
])
def test_ambiguous_framing_is_refused_400_and_never_forwarded(guard, upstream, head, words):
    attack = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n" + b"5\r\nhello\r\n0\r\n\r\n"
    [(status, _, data)] = raw_exchange(guard.port, attack)
    assert status in (400, 501), data
    message = json.loads(data)["error"]["message"]
    assert words in message and "\n" not in message
    assert upstream.seen == []


def test_a_chunked_prompt_is_sized_whole_and_forwarded_with_its_length(guard, upstream):
    def chunked(body: bytes) -> bytes:
        pieces = [body[i:i + 1000] for i in range(0, len(body), 1000)]
        return b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"

    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    [(status, _, data)] = raw_exchange(guard.port, head + chunked(BIG))
    assert status == 503 and json.loads(data)["error"]["prompt_tokens"] == 5000
    assert _prompts(upstream) == []
    small = json.dumps({"prompt": "a few words"}).encode()
    [(status, _, _)] = raw_exchange(guard.port, head + chunked(small))
    assert status == 200 and _prompts(upstream) == [small]


def test_pipelined_requests_are_each_decided_and_answered_in_order(guard, upstream):
    small = json.dumps({"prompt": "hi"}).encode()
    answers = raw_exchange(guard.port, _post(BIG) + _post(small) + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
                           answers=3)
    assert [a[0] for a in answers] == [503, 200, 200]
    assert b"choices" in answers[1][2] and b'"object": "list"' in answers[2][2]
    assert _prompts(upstream) == [small]


def test_an_upstream_that_answers_twice_never_gives_the_next_client_the_extra_answer(guard, upstream):
    """The review's desync: after a smuggle the pooled upstream connection held one extra response, which the
    next client received. An upstream connection is reused only when nothing follows its answer."""
    smuggled = b'{"smuggled": "answer"}'
    upstream.extra_answer = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(smuggled), smuggled))
    status, _, data = request(guard.url, "GET", "/v1/models")
    assert status == 200 and b"smuggled" not in data
    for prompt in ("one", "two", "three"):
        status, _, data = request(guard.url, "POST", "/v1/completions", {"prompt": prompt})
        assert status == 200 and b"smuggled" not in data and json.loads(data)["choices"], data


def test_an_http_1_0_client_gets_a_stream_in_http_1_0_framing(guard, upstream):
    body = json.dumps({"prompt": "word " * 10, "stream": True}).encode()
    direct = request(upstream.url, "POST", "/v1/completions", raw=body)[2]
    with socket.create_connection(("127.0.0.1", guard.port), timeout=10) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.0\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        answer = b""
        while chunk := sock.recv(65536):  # the guard closes the connection at the stream's end
            answer += chunk
    head, _, content = answer.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].split(b" ")[1] == b"200"
    assert b"transfer-encoding" not in head.lower() and b"connection: close" in head.lower()
    assert content == direct


def test_a_get_through_the_guard_reaches_the_upstream_without_a_body(guard, upstream):
    status, _, _ = request(guard.url, "GET", "/v1/models", raw=b"", headers={"Content-Length": "0"})
    assert status == 200 and upstream.seen == [("GET", "/v1/models", b"")]


@pytest.mark.parametrize(("attack", "status", "words"), [
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nContent-Length: 5\r\n\r\n"
     b"\x1f\x8b\x08\x00\x00", 415, "Content-Encoding"),
    (b"GET /v1/models HTTP/2.0\r\nHost: x\r\n\r\n", 505, "HTTP/2.0 is not supported"),
    (b"GET /v1/models HTTP/1.1\r\n\r\n", 400, "Host"),
])
def test_a_compressed_body_or_another_protocol_is_refused_and_never_forwarded(guard, upstream, attack, status, words):
    [(got, _, data)] = raw_exchange(guard.port, attack)
    assert got == status and words in json.loads(data)["error"]["message"]
    assert upstream.seen == []


def test_header_bytes_beyond_ascii_are_passed_on_as_they_came(guard, upstream):
    [(status, _, _)] = raw_exchange(guard.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Name: caf\xe9\r\n\r\n")
    assert status == 200 and upstream.paths() == ["/v1/models"]


def test_a_client_that_expects_100_continue_gets_it_before_sending_its_body(guard, upstream):
    body = json.dumps({"prompt": "hi"}).encode()
    with socket.create_connection(("127.0.0.1", guard.port), timeout=5) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 100 ")
        sock.sendall(body)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
    assert _prompts(upstream) == [body]
