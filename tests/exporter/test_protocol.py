"""The exporter's HTTP through h11 (telemetry/exporter/protocol.py), driven without a socket: bytes in, requests and
framed responses out."""

from __future__ import annotations

import h11
import pytest

from telemetry.exporter.protocol import BadRequest, frame_response, keeps_alive, new_connection, next_request

GET = b"GET /metrics?x=1 HTTP/1.1\r\nHost: x\r\nAuthorization: Basic YTpi\r\n\r\n"


def answer(http: h11.Connection, body: bytes = b"ok\n", **kwargs) -> bytes:
    return frame_response(http, 200, body, "text/plain; charset=utf-8", **kwargs)


def test_a_request_split_anywhere_is_read_once_complete_and_pipelined_ones_follow_their_answers():
    http = new_connection(16384)
    stream = GET + b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    for i, byte in enumerate(GET[:-1]):   # a byte at a time: nothing until the head is complete
        http.receive_data(bytes([byte]))
        assert next_request(http) is None, i
    http.receive_data(stream[len(GET) - 1:])
    first = next_request(http)
    assert first is not None
    assert (first.method, first.path, first.version, first.authorization) == ("GET", "/metrics", "HTTP/1.1",
                                                                              "Basic YTpi")
    assert next_request(http) is None   # the pipelined HEAD waits for the GET's answer
    wire = answer(http)
    assert wire.startswith(b"HTTP/1.1 200 OK\r\n") and wire.endswith(b"\r\n\r\nok\n") and keeps_alive(http)
    second = next_request(http)
    assert second is not None and (second.method, second.path, second.authorization) == ("HEAD", "/healthz", None)
    head = answer(http, head_only=True)
    assert b"Content-Length: 3\r\n" in head and head.endswith(b"\r\n\r\n")   # a HEAD answer: its length, no body


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"GET /metrics HTTP/1.1\r\n\r\n", 400),                                     # no Host (RFC 9112 section 3.2)
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc", 413),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 413),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nContent-Length: 5\r\n\r\n", 400),  # conflicting
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nTransfer-Encoding: chunked\r\n\r\n", 413),
    (b"GET /metrics HTTP/2.0\r\n\r\n", 505),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 300, 431),               # past the head bound, incomplete
    (b"GET /metrics HTTP/1.1\r\nHost x\r\n\r\n", 400),
    (b"GET /me trics HTTP/1.1\r\nHost: x\r\n\r\n", 400),
])
def test_what_h11_refuses_or_an_exporter_does_not_serve_is_a_status_and_a_close(request_bytes, status):
    http = new_connection(256)
    http.receive_data(request_bytes)
    with pytest.raises(BadRequest) as refused:
        next_request(http)
    assert refused.value.status == status
    wire = frame_response(http, refused.value.status, f"{refused.value}\n".encode(), "text/plain", close=True)
    assert wire.startswith(f"HTTP/1.1 {status} ".encode()) and b"Connection: close\r\n" in wire
    assert not keeps_alive(http)


@pytest.mark.parametrize("request_bytes", [b"HEAD /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",
                                           b"HEAD /metrics HTTP/2.0\r\n\r\n"])
def test_a_refused_head_request_is_answered_without_a_body(request_bytes):
    """h11 will not send a body after HEAD: the refusal says so, and its answer is the head alone."""
    http = new_connection(256)
    http.receive_data(request_bytes)
    with pytest.raises(BadRequest) as refused:
        next_request(http)
    assert refused.value.head_only
    wire = frame_response(http, refused.value.status, b"refused\n", "text/plain", close=True,
                          head_only=refused.value.head_only)
    assert b"Content-Length: 8\r\n" in wire and wire.endswith(b"\r\n\r\n")


def test_an_absolute_form_target_is_served_by_its_path():
    http = new_connection(16384)
    http.receive_data(b"GET http://x:9101/metrics?q HTTP/1.1\r\nHost: x\r\n\r\n")
    request = next_request(http)
    assert request is not None and request.path == "/metrics"


def test_http10_and_connection_close_end_the_connection_after_the_answer():
    for raw, expect_close in [(b"GET / HTTP/1.0\r\n\r\n", True),
                              (b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", True),   # h11: no 1.0 keep-alive
                              (b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", True),
                              (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", False)]:
        http = new_connection(16384)
        http.receive_data(raw)
        assert next_request(http) is not None
        wire = answer(http)
        assert (b"Connection: close\r\n" in wire) is expect_close and keeps_alive(http) is not expect_close, raw
    http = new_connection(16384)   # a server that is stopping asks h11 to close
    http.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert next_request(http) is not None
    assert b"Connection: close\r\n" in answer(http, close=True) and not keeps_alive(http)
