"""HTTP endpoints of the daemon: /metrics (Prometheus text format), /healthz (JSON), nothing else.

The socket is bound in the constructor, before anything else starts, so "port in use" is a clear
error with nothing half-started. Each connection gets a thread; HTTP/1.1 keep-alive is supported
so a scraper that reuses its connection pays no connect cost.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger("memtel.daemon")


class ListenError(OSError):
    pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    registry: CollectorRegistry
    health: Callable[[], dict]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            try:
                body = generate_latest(self.server.registry)
            except Exception as exc:  # the wrapper already isolates collectors; this is a last guard
                log.exception("rendering /metrics failed")
                self._send(500, f"rendering metrics failed: {exc}\n".encode(), "text/plain; charset=utf-8")
                return
            self._send(200, body, CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            self._send(200, json.dumps(self.server.health()).encode() + b"\n", "application/json")
        elif path == "/":
            self._send(200, b"memtel daemon: see /metrics and /healthz\n", "text/plain; charset=utf-8")
        else:
            self._send(404, b"not found: try /metrics or /healthz\n", "text/plain; charset=utf-8")

    def setup(self) -> None:
        super().setup()
        if self.request.family in (socket.AF_INET, socket.AF_INET6):
            # Without this, Nagle's algorithm and the client's delayed ACK can hold a response for 40 ms.
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        # Headers and body in one write (one segment on loopback), instead of end_headers() + write().
        self._headers_buffer.append(b"\r\n" + body)
        self.flush_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass  # one line per scrape would flood the journal


class MetricsServer:
    def __init__(self, host: str, port: int, registry: CollectorRegistry, health: Callable[[], dict]) -> None:
        server_class = _Server
        if ":" in host:
            server_class = type("_Server6", (_Server,), {"address_family": socket.AF_INET6})
        try:
            self.httpd = server_class((host, port), _Handler)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            hint = ""
            if exc.errno == errno.EADDRINUSE:
                hint = " (another exporter or memtel daemon is using it; choose another with --listen HOST:PORT)"
            elif exc.errno == errno.EACCES:
                hint = " (ports below 1024 need root or CAP_NET_BIND_SERVICE)"
            raise ListenError(f"cannot listen on {host}:{port}: {reason}{hint}") from None
        self.httpd.registry = registry
        self.httpd.health = health
        self.port = self.httpd.server_address[1]
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="memtel-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(5)
        self.httpd.server_close()
