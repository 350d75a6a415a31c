"""Issue 19, item 3: a pipelined burst stalls scrapes.

Before: every pipelined request ran every collector on the selector thread, one connection's whole buffer
at a time, so 16 connections pipelining ~400 requests each made the next real scrape take seconds.
Now a connection answers a bounded number per turn and requests share one fresh collection.
"""

from __future__ import annotations

import base64
import socket
import ssl
import threading
import time
from pathlib import Path

import bcrypt
import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from telemetry.exporter import MetricsServer
from telemetry.exporter.auth import BasicAuth
from telemetry.exporter.webconfig import WebConfig
from tests.daemon.helpers import Daemon
from tests.support.certs import Certs, make_certs

REQUEST = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
PIPELINED = 400  # 400 * 35 bytes: within the server's 16 KiB bound on what one connection may queue
CONNECTIONS = 16


class _Collections:
    """Counts collections; each one's number is its sample value, so a response says which it came from."""

    def __init__(self) -> None:
        self.count = 0

    def collect(self):
        self.count += 1
        family = CounterMetricFamily("memtel_test_collections", "Collections made so far.")
        family.add_metric([], self.count)
        yield family


class _Large:
    """About 100 kB of samples, so a burst's answers back up in the sockets of clients that do not read."""

    def collect(self):
        family = GaugeMetricFamily("memtel_test_large", "Many samples.", labels=["i"])
        for i in range(2000):
            family.add_metric([str(i)], float(i))
        yield family


def _collection_number(body: bytes) -> int:
    line = next(line for line in body.splitlines() if line.startswith(b"memtel_test_collections_total "))
    return int(float(line.split()[1]))


def _read_responses(sock: socket.socket, count: int) -> list[bytes]:
    stream = sock.makefile("rb")
    bodies = []
    for _ in range(count):
        length = 0
        while (line := stream.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        bodies.append(stream.read(length))
    return bodies


def test_pipelined_requests_share_one_fresh_collection():
    counter = _Collections()
    registry = CollectorRegistry()
    registry.register(counter)
    server = MetricsServer("127.0.0.1", 0, registry)
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(REQUEST * PIPELINED)
            bodies = _read_responses(sock, PIPELINED)
            assert len(bodies) == PIPELINED and all(b"memtel_test_collections_total" in b for b in bodies)
            shared = counter.count
            assert shared <= 4, f"{shared} collections for {PIPELINED} pipelined requests"
            # A request sent after the last answer arrived is never served the older collection.
            for _ in range(3):
                sock.sendall(REQUEST)
                (body,) = _read_responses(sock, 1)
                assert _collection_number(body) == counter.count > shared
                shared = counter.count
        assert server.collections == counter.count
    finally:
        server.stop()


def test_pipelined_burst_does_not_stall_scrapes(tmp_path: Path):
    (tmp_path / "kern.log").touch()
    with Daemon(tmp_path / "state", "--kmsg", str(tmp_path / "kern.log"), "--disable-collector", "nvml") as daemon:
        burst = [socket.create_connection(("127.0.0.1", daemon.port), timeout=5) for _ in range(CONNECTIONS)]
        drained: list[int] = []

        def drain(sock: socket.socket) -> None:  # half the burst reads its answers, half never does
            got = 0
            try:
                while chunk := sock.recv(1 << 20):
                    got += chunk.count(b"HTTP/1.1 200 OK")
            except OSError:
                pass
            drained.append(got)

        readers = [threading.Thread(target=drain, args=(s,), daemon=True) for s in burst[::2]]
        try:
            for sock in burst:
                sock.sendall(REQUEST * PIPELINED)
            for reader in readers:
                reader.start()
            worst = 0.0
            with httpx.Client(timeout=5) as client:
                for _ in range(5):
                    started = time.monotonic()
                    response = client.get(daemon.url + "/metrics")
                    worst = max(worst, time.monotonic() - started)
                    assert response.status_code == 200 and "memtel_collector_success" in response.text
            print(f"worst scrape during {CONNECTIONS} x {PIPELINED} pipelined requests: {worst * 1e3:.0f} ms")
            assert worst < 1.0
        finally:
            for sock in burst:
                sock.close()
            for reader in readers:
                reader.join(5)
        assert daemon.scrape().value("memtel_collector_success", collector="meminfo") == 1


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.mark.parametrize("tls", [False, True], ids=["basic-auth", "tls-and-basic-auth"])
def test_a_pipelined_burst_that_never_reads_does_not_hold_the_workers(tls, certs):
    """With basic auth or TLS every request goes to a worker thread; before, a worker wrote a pipelined burst's
    answers with a blocking write, so 4 clients that never read held all 4 workers for the write timeout (10 s)."""
    registry = CollectorRegistry()
    registry.register(_Collections())
    registry.register(_Large())
    auth = BasicAuth({"prometheus": bcrypt.hashpw(b"secret", bcrypt.gensalt(4))})
    context = None
    if tls:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(certs.server_cert, certs.server_key)
    server = MetricsServer("127.0.0.1", 0, registry, web_config=WebConfig(tls=context, basic_auth=auth))
    server.start()
    header = b"Authorization: Basic " + base64.b64encode(b"prometheus:secret") + b"\r\n"
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n"
    burst = []
    client_context = ssl.create_default_context(cafile=str(certs.ca))
    try:
        for _ in range(CONNECTIONS):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and never read: the answers back up
            if tls:
                sock = client_context.wrap_socket(sock, server_hostname="127.0.0.1")
            burst.append(sock)
            sock.sendall(request * (16000 // len(request)))
        worst = 0.0
        with httpx.Client(timeout=5, verify=client_context) as client:
            for _ in range(5):
                started = time.monotonic()
                response = client.get(server.url + "/metrics", auth=("prometheus", "secret"))
                worst = max(worst, time.monotonic() - started)
                assert response.status_code == 200
        print(f"worst scrape ({'TLS + ' if tls else ''}basic auth), burst that never reads: {worst * 1e3:.0f} ms")
        assert worst < 1.0, f"worst scrape {worst:.2f} s"
    finally:
        for sock in burst:
            sock.close()
        server.stop()
