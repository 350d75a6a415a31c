"""telemetry.exporter.MetricsServer in-process, over real loopback sockets: keep-alive, timeouts, bounds."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from telemetry.errors import ConfigError
from telemetry.exporter import ListenError, MetricsServer, ServerLimits


@pytest.fixture
def registry():
    registry = CollectorRegistry()
    Counter("memtel_test_things", "Things counted by the test.", registry=registry).inc(3)
    return registry


def serve(registry, **limits) -> MetricsServer:
    server = MetricsServer("127.0.0.1", 0, registry, health=lambda: {"status": "ok"},
                           limits=ServerLimits(**limits) if limits else None)
    server.start()
    return server


def raw(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def read_response(stream) -> tuple[bytes, bytes]:
    """(head, body) of one response from a socket's buffered reader, read by its Content-Length."""
    lines = []
    while True:
        line = stream.readline()
        if line in (b"\r\n", b""):
            break
        lines.append(line.rstrip(b"\r\n"))
    head = b"\r\n".join(lines)
    length = int(next(line.split(b":")[1] for line in lines if line.lower().startswith(b"content-length")))
    return head, stream.read(length)


def closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def count_soon(server: MetricsServer, what: str, timeout: float = 10) -> int:
    """`server.counts()[what]` once it is there: the server counts a close just after closing the socket, so a
    client that saw the close may read the count a moment before it is made (a busy machine widens it)."""
    deadline = time.monotonic() + timeout
    while what not in server.counts() and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.counts().get(what, 0)


def test_metrics_healthz_and_keep_alive_on_one_connection(registry):
    server = serve(registry)
    try:
        with httpx.Client() as client:
            first = client.get(server.url + "/metrics")
            second = client.get(server.url + "/healthz")
        assert first.status_code == 200 and b"memtel_test_things_total 3.0" in first.content
        assert first.headers["content-type"].startswith("text/plain")
        assert second.json() == {"status": "ok"}
        assert server.counts()["accepted"] == 1  # both requests on one kept-alive connection
    finally:
        server.stop()


def test_connection_close_http10_and_pipelining(registry):
    server = serve(registry)
    try:
        with raw(server.port) as sock, sock.makefile("rb") as stream:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            head1, body1 = read_response(stream)
            head2, body2 = read_response(stream)
            assert b"200 OK" in head1 and body1 == b'{"status": "ok"}\n'
            assert b"200 OK" in head2 and b"memtel_test_things_total" in body2
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            head3, _ = read_response(stream)
            assert b"200 OK" in head3 and b"Connection: close" in head3 and stream.read() == b""  # then it closes
        # HTTP/1.0 is answered, then closed, even when it asks for keep-alive: h11 does not keep HTTP/1.0 alive.
        for request in (b"GET /metrics HTTP/1.0\r\n\r\n", b"GET /metrics HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"):
            with raw(server.port) as sock, sock.makefile("rb") as stream:
                sock.sendall(request)
                head, body = read_response(stream)
                assert b"200 OK" in head and b"memtel_test_things_total" in body
                assert b"Connection: close" in head and stream.read() == b""
    finally:
        server.stop()


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"GARBAGE\r\n\r\n", b"400"),
    (b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", b"405"),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello", b"413"),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", b"413"),
    (b"HEAD /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello", b"413"),  # answered without a body
    (b"GET /metrics HTTP/1.1\r\n\r\n", b"400"),  # HTTP/1.1 without Host (RFC 9112 section 3.2)
    (b"GET /metrics HTTP/2.0\r\n\r\n", b"505"),
    (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n", b"431"),
    (b"GET /metrics HTTP/1.1\r\nbad header line\r\n\r\n", b"400"),
    (b"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n", b"404"),
])
def test_bad_requests_get_a_status_and_the_server_goes_on(registry, request_bytes, status):
    server = serve(registry)
    try:
        with raw(server.port) as sock, sock.makefile("rb") as stream:
            sock.sendall(request_bytes)
            head, _ = read_response(stream)
            assert head.split(b" ")[1] == status
        assert httpx.get(server.url + "/metrics").status_code == 200
    finally:
        server.stop()


def test_a_request_then_the_clients_half_close_is_answered(registry):
    """`printf 'GET ...' | nc -N`: the request and the end of the client's side arrive together; the answer goes
    out before the connection ends (before, the end was read first and the request was dropped)."""
    server = serve(registry)
    try:
        with raw(server.port) as sock, sock.makefile("rb") as stream:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.shutdown(socket.SHUT_WR)
            head, body = read_response(stream)
            assert b"200 OK" in head and b"memtel_test_things_total 3.0" in body
    finally:
        server.stop()


def test_idle_connections_are_closed_after_the_idle_timeout(registry):
    server = serve(registry, idle_timeout_seconds=0.5)
    try:
        with raw(server.port) as sock:
            started = time.monotonic()
            assert closed_by_server(sock, 3)
            assert 0.4 < time.monotonic() - started < 2
        assert count_soon(server, "closed_idle_timeout") == 1
    finally:
        server.stop()


def test_a_request_sent_a_byte_at_a_time_is_cut_off_by_the_request_timeout(registry):
    server = serve(registry, request_timeout_seconds=0.6, idle_timeout_seconds=60)
    try:
        with raw(server.port) as sock:
            started = time.monotonic()
            closed = False
            for byte in b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 100:
                try:
                    sock.send(bytes([byte]))
                except OSError:
                    closed = True
                    break
                time.sleep(0.05)
                if time.monotonic() - started > 3:
                    break
            assert closed or closed_by_server(sock, 1)
            assert time.monotonic() - started < 3
        assert count_soon(server, "closed_request_timeout") == 1
        assert httpx.get(server.url + "/metrics").status_code == 200
    finally:
        server.stop()


def test_past_max_connections_the_idlest_is_closed_and_a_scrape_still_answers(registry):
    server = serve(registry, max_connections=16)
    socks = [raw(server.port) for _ in range(40)]
    try:
        time.sleep(0.2)
        assert server.open_connections <= 16
        started = time.monotonic()
        assert httpx.get(server.url + "/metrics", timeout=2).status_code == 200
        assert time.monotonic() - started < 1
        assert server.counts()["closed_evicted"] >= 40 - 16
        assert closed_by_server(socks[0], 1)  # the oldest went first
    finally:
        for sock in socks:
            sock.close()
        server.stop()


def test_stop_closes_every_connection_and_the_port(registry):
    server = serve(registry)
    socks = [raw(server.port) for _ in range(5)]
    time.sleep(0.1)
    server.stop()
    try:
        assert all(closed_by_server(sock, 2) for sock in socks)
    finally:
        for sock in socks:
            sock.close()
    with pytest.raises(ConnectionRefusedError):
        raw(server.port)


def test_listen_errors_say_what_is_wrong(registry):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ListenError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            MetricsServer("127.0.0.1", port, registry)
    with pytest.raises(ConfigError, match="not one of this machine's"):
        MetricsServer("192.0.2.1", 0, registry)  # TEST-NET-1: on no interface here
    with pytest.raises(ConfigError, match=r"cannot listen on no-such-host\.invalid:0"):
        MetricsServer("no-such-host.invalid", 0, registry)


def test_backlog_is_large(registry):
    server = MetricsServer("127.0.0.1", 0, registry)
    try:
        # /proc/net/tcp does not show the backlog; ss does (Send-Q of a listening socket).
        import subprocess

        out = subprocess.run(["ss", "-ltnH", f"sport = :{server.port}"], capture_output=True, text=True).stdout
        if not out.strip():
            pytest.skip("ss (iproute2) is not available to read the backlog")
        assert int(out.split()[2]) >= 128
    finally:
        server.stop()


def test_a_client_that_does_not_read_a_large_response_stalls_no_one(registry):
    class Bulk:  # a body of ~8 MB: more than a loopback socket takes at once
        def collect(self):
            family = GaugeMetricFamily("memtel_test_bulk", "A gauge that makes the body large.", labels=["i"])
            for i in range(2000):
                family.add_metric([f"{i:08d}" + "x" * 4000], i)
            yield family

    registry.register(Bulk())
    server = serve(registry, write_timeout_seconds=5)
    try:
        with socket.socket() as slow:
            slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
            slow.settimeout(10)
            slow.connect(("127.0.0.1", server.port))
            slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            time.sleep(0.3)  # the response is stuck in the socket: the rest waits with a worker
            started = time.monotonic()
            assert httpx.get(server.url + "/healthz", timeout=2).status_code == 200
            assert time.monotonic() - started < 2  # not the 5 s write timeout: the stuck writer holds no one up
            with slow.makefile("rb") as stream:
                head, body = read_response(stream)
        assert b"200 OK" in head and body.endswith(b'x"} 1999.0\n')
        assert server.counts()["partial_writes"] == 1  # the rest went through a worker
    finally:
        server.stop()
