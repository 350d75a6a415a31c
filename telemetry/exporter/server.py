"""A /metrics HTTP server that idle connections, slow clients and connection floods cannot stop.

One selector thread owns every connection while it waits for a request: it accepts, reads, runs TLS
handshakes without blocking and closes connections that stay idle (`idle_timeout_seconds`) or take
too long to send a request (`request_timeout_seconds`). The same thread answers complete requests
(plain or TLS): it renders the registry and writes what the socket takes at once; the rest of an answer
waits for the socket to become writable (closed after `write_timeout_seconds`). Only a login that needs
a bcrypt check goes to a small pool of worker threads (`workers`), which answer the same way and hand the
connection back. Each connection's HTTP is an h11 state machine (protocol.py): h11 parses what was read
and frames every answer; this module owns only the sockets, the timeouts and the bounds. So a scrape costs
no thread of its own, a client that does not read holds no thread, and an idle connection costs one file
descriptor and nothing else.

The number of open connections is bounded (`max_connections`, and never more than the process's
open-file limit allows): past it, the connection idle the longest is closed to make room, so a flood
of idle connections can delay a scrape by one accept, not stop it. The listen backlog is large
(`backlog`), so 50 scrapers connecting at once do not wait for SYN retransmits. Accept errors such as
EMFILE pause accepting briefly instead of spinning a core.

Pipelined requests are bounded and served in turns: a connection is not read again while what h11
holds unparsed (at most `max_request_bytes`, also the bound on a request head: 431 past it) still holds a
complete request, it gets at most `pipelined_per_turn` answers before every other ready connection has had
its turn, and a response the client does not read
waits on the selector for the socket to become writable (closed after `write_timeout_seconds`) without
holding a thread. Every /metrics answer comes from a `SharedCollection`: requests read in the same
turn, or pipelined on one connection, share one collection that began after they arrived.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import logging
import os
import resource
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from telemetry.errors import ConfigError, RunError
from telemetry.exporter.address import format_listen
from telemetry.exporter.exposition import Renderer
from telemetry.exporter.protocol import (
    BadRequest,
    Request,
    frame_response,
    keeps_alive,
    new_connection,
    next_request,
)
from telemetry.exporter.shared_collection import SharedCollection
from telemetry.exporter.webconfig import WebConfig

log = logging.getLogger("memtel.exporter")

_TEXT = "text/plain; charset=utf-8"
_SWEEP_SECONDS = 0.25  # how often timeouts are checked
_ACCEPTS_PER_TURN = 64  # so timeouts and reads are served during an accept flood
_FD_RESERVE = 64  # descriptors left for the process's own files when bounding connections


class ListenError(RunError):
    """The address could not be bound (in use, no permission)."""


@dataclass(frozen=True)
class ServerLimits:
    max_connections: int = 256
    idle_timeout_seconds: float = 90.0  # a connection without a request since it opened or since its last response
    request_timeout_seconds: float = 10.0  # from a request's first byte (or the TLS hello) to its last header
    write_timeout_seconds: float = 10.0
    backlog: int = 1024
    workers: int = 4
    max_request_bytes: int = 16384  # also bounds what one connection can have queued (pipelined requests)
    pipelined_per_turn: int = 8  # answers one connection gets before the other ready connections get theirs


class _Connection:
    __slots__ = ("busy", "close_after", "handshaking", "http", "peer", "pending", "queued", "received_at", "request",
                 "request_started", "since", "sock", "write_started")

    def __init__(self, sock: socket.socket, peer: object, now: float, handshaking: bool, max_head_bytes: int) -> None:
        self.sock = sock
        self.peer = peer
        self.http = new_connection(max_head_bytes)  # h11: what was read and not yet parsed, the exchange's state
        self.request: Request | BadRequest | None = None  # parsed from `http`, not yet answered
        self.since = now
        self.request_started: float | None = now if handshaking else None
        self.busy = False
        self.handshaking = handshaking
        self.pending = b""  # the rest of a response the socket did not take at once
        self.close_after = False  # close once `pending` is sent
        self.write_started: float | None = None  # when `pending` began to wait for the socket
        self.received_at = now  # when bytes were last read: every request `http` holds arrived by then
        self.queued = False  # in the server's ready queue


_LISTENER = object()
_WAKE = object()


class MetricsServer:
    """Serves `/metrics` from `registry`, `/healthz` from `health()` if given, and a short `/` page.

    The socket is bound in the constructor (ListenError, or ConfigError for an address that is not
    on this machine), so a caller can fail before starting anything else. `start()` serves in
    daemon threads; `stop()` closes everything.
    """

    def __init__(self, host: str, port: int, registry: CollectorRegistry, *,
                 health: Callable[[], Mapping[str, object]] | None = None, web_config: WebConfig | None = None,
                 limits: ServerLimits | None = None, name: str = "memtel") -> None:
        self.registry = registry
        self._renderer = Renderer()
        self._collection = SharedCollection(lambda: self._renderer.render(self.registry))
        self.health = health
        self.web_config = web_config or WebConfig()
        self.limits = limits or ServerLimits()
        self.name = name
        self._listener = _bind(host, port, self.limits.backlog)
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        self.max_connections = _bounded_connections(self.limits.max_connections)
        self.stats: collections.Counter[str] = collections.Counter()
        self._stats_lock = threading.Lock()
        self._conns: set[_Connection] = set()
        self._returned: collections.deque[_Connection] = collections.deque()
        self._ready: collections.deque[_Connection] = collections.deque()  # complete requests, served in turns
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._pool: ThreadPoolExecutor | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._accept_paused_until = 0.0
        self._logged: set[str] = set()

    @property
    def url(self) -> str:
        scheme = "https" if self.web_config.tls is not None else "http"
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else "::1" if self.host == "::" else self.host
        return f"{scheme}://{format_listen(host, self.port)}"

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def _count(self, what: str) -> None:
        with self._stats_lock:
            self.stats[what] += 1

    def counts(self) -> dict[str, int]:
        """Connections accepted, closed by reason, requests served, ... since start (for /healthz and tests)."""
        with self._stats_lock:
            return dict(self.stats)

    @property
    def collections(self) -> int:
        """How many times /metrics was collected (requests that shared a collection count once)."""
        return self._collection.runs

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._pool = ThreadPoolExecutor(self.limits.workers, thread_name_prefix=f"{self.name}-http-worker")
        self._selector.register(self._listener, selectors.EVENT_READ, _LISTENER)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._thread = threading.Thread(target=self._serve, name=f"{self.name}-http", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        for conn in list(self._conns):
            self._close(conn, "stopped", unregister=False)
        while self._returned:
            self._close(self._returned.popleft(), "stopped", unregister=False)
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        with contextlib.suppress(Exception):
            self._selector.close()

    def close_after_fork(self) -> None:
        """In a forked child: close the inherited descriptors only (no shutdown: the parent keeps serving)."""
        for conn in list(self._conns):
            with contextlib.suppress(OSError):
                conn.sock.close()
        self._conns.clear()
        for sock in (self._listener, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                sock.close()
        with contextlib.suppress(Exception):
            self._selector.close()
        self._pool = None
        self._thread = None
        self._stopping = True

    # -- the selector thread -------------------------------------------------------------------------
    def _serve(self) -> None:
        next_sweep = time.monotonic() + _SWEEP_SECONDS
        while not self._stopping:
            try:
                wait = 0.0 if self._ready else max(0.0, next_sweep - time.monotonic())
                events = self._selector.select(wait)
            except OSError as exc:  # should not happen; never spin on it
                self._log_once(f"select failed: {exc}")
                time.sleep(0.1)
                continue
            for key, _mask in events:
                data = key.data
                try:
                    if data is _LISTENER:
                        self._accept()
                    elif data is _WAKE:
                        self._take_back()
                    else:
                        self._on_readable(data)
                except Exception as exc:  # one bad connection must never stop the server
                    self._log_once(f"connection handling failed: {type(exc).__name__}: {exc}")
                    if isinstance(data, _Connection):
                        self._close(data, "error")
            self._serve_ready()
            now = time.monotonic()
            if now >= next_sweep:
                self._sweep(now)
                next_sweep = now + _SWEEP_SECONDS

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_TURN):
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._log_once(f"accepting a connection failed: {exc.strerror}; closing idle connections")
                    if not self._evict_idlest():
                        self._pause_accepting(0.1)
                        return
                    continue
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue
                self._log_once(f"accepting a connection failed: {exc}")
                self._pause_accepting(0.1)
                return
            self._count("accepted")
            if len(self._conns) >= self.max_connections and not self._evict_idlest():
                self._count("rejected")
                sock.close()
                continue
            self._add(sock, peer)

    def _add(self, sock: socket.socket, peer: object) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # Without this, Nagle's algorithm and the client's delayed ACK can hold a response for 40 ms.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tls = self.web_config.tls
        if tls is not None:
            try:
                sock = tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            except (OSError, ValueError):
                sock.close()
                self._count("tls_failed")
                return
        conn = _Connection(sock, peer, time.monotonic(), handshaking=tls is not None,
                           max_head_bytes=self.limits.max_request_bytes)
        self._conns.add(conn)
        self._selector.register(sock, selectors.EVENT_READ, conn)

    def _pause_accepting(self, seconds: float) -> None:
        # Level-triggered: a listener left registered while accept() keeps failing would spin a core.
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self._listener)
        self._accept_paused_until = time.monotonic() + seconds

    def _evict_idlest(self) -> bool:
        """Close the connection that has waited longest for a request (not one being answered)."""
        idle = [c for c in self._conns if not c.busy]
        if not idle:
            return False
        self._close(min(idle, key=lambda c: c.since), "evicted")
        return True

    def _on_readable(self, conn: _Connection) -> None:
        if conn.busy or conn.queued:
            return  # a worker has it, or its buffered requests come first (it is not read meanwhile)
        sock = conn.sock
        if conn.handshaking:
            assert isinstance(sock, ssl.SSLSocket)
            try:
                sock.do_handshake()
            except ssl.SSLWantReadError:
                return
            except ssl.SSLWantWriteError:
                self._selector.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
                return
            except (ssl.SSLError, OSError):
                self._close(conn, "tls_failed")
                return
            conn.handshaking = False
            conn.request_started = None
            conn.since = time.monotonic()
            self._selector.modify(sock, selectors.EVENT_READ, conn)
        if conn.pending:  # writable again: the rest of a response first, nothing is read meanwhile
            self._flush(conn)
            return
        limit = self.limits.max_request_bytes
        held = _unparsed(conn)
        # A plain socket that gave less than asked is empty for now (the selector says when more comes): no
        # recv that fails with EAGAIN. TLS may hold decrypted bytes the socket does not show, so it reads on.
        plain = not isinstance(sock, ssl.SSLSocket)
        while held <= limit:
            wanted = min(65536, limit + 1 - held)
            try:
                chunk = sock.recv(wanted)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            except (ssl.SSLError, OSError):
                self._close(conn, "reset")
                return
            if not chunk:
                self._close(conn, "client_closed")
                return
            if conn.request_started is None:
                conn.request_started = time.monotonic()
            conn.http.receive_data(chunk)
            held += len(chunk)
            if plain and len(chunk) < wanted:
                break
        conn.received_at = time.monotonic()
        self._queue_if_ready(conn)

    def _queue_if_ready(self, conn: _Connection) -> None:
        """Queue the connection if h11 has a complete request in what it read (or one it refuses)."""
        if conn.queued:
            return
        if conn.request is None:
            try:
                conn.request = next_request(conn.http)
            except BadRequest as exc:
                conn.request = exc
        if conn.request is not None:
            conn.queued = True
            self._ready.append(conn)

    def _serve_ready(self) -> None:
        """One turn: each connection queued before it began answers up to `pipelined_per_turn` requests."""
        for _ in range(len(self._ready)):
            conn = self._ready.popleft()
            conn.queued = False
            if conn not in self._conns or conn.busy:
                continue
            try:
                if not self._answer_here(conn):
                    self._dispatch(conn)
                else:
                    self._read_tls_buffer(conn)
            except Exception as exc:  # one bad connection must never stop the server
                self._log_once(f"connection handling failed: {type(exc).__name__}: {exc}")
                self._close(conn, "error")

    def _read_tls_buffer(self, conn: _Connection) -> None:
        """Read what TLS has decrypted already: select() cannot see it (it is in the SSL object, not the socket),
        and a connection that had more than its buffer's bound pipelined would otherwise wait for new bytes."""
        sock = conn.sock
        if (isinstance(sock, ssl.SSLSocket) and not conn.queued and not conn.busy and not conn.pending
                and not conn.handshaking and conn in self._conns and sock.pending()):
            self._on_readable(conn)

    def _answer_here(self, conn: _Connection) -> bool:
        """Answer requests on this thread (no hand-over to a worker and back), plain HTTP or TLS.

        Rendering takes milliseconds and is shared (`SharedCollection`); the response is written without
        blocking, and whatever the socket does not take at once waits for the socket to become writable
        (`_flush`), so a client that does not read holds neither this thread nor a worker. At most
        `pipelined_per_turn` requests are answered; the connection then queues behind the others; a request
        h11 refuses is answered with its status and the connection closed. A login that needs a bcrypt check
        (~70 ms; `BasicAuth.answered_without_bcrypt`) goes to a worker, so a flood of new wrong passwords delays
        no scraper whose login is cached. False: hand over.
        """
        auth = self.web_config.basic_auth
        for _ in range(self.limits.pipelined_per_turn):
            request = self._take_request(conn)
            if request is None:
                return True
            if (isinstance(request, Request) and auth is not None
                    and not auth.answered_without_bcrypt(request.authorization)):
                conn.request = request  # the worker answers it
                return False
            data, keep_alive = self._respond(conn, request)
            try:
                sent_all = self._send(conn, data, keep_alive)
            except OSError:  # ssl.SSLError too
                self._close(conn, "reset")
                return True
            if not sent_all:
                self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
                return True
            if not keep_alive:
                self._close(conn, "done")
                return True
            now = time.monotonic()
            conn.since = now
            conn.request_started = now if _unparsed(conn) else None
        self._queue_if_ready(conn)  # more pipelined requests: after every other ready connection
        return True

    def _flush(self, conn: _Connection) -> None:
        """Send more of `pending` (the socket is writable); once all is sent, serve or read again."""
        try:
            sent = conn.sock.send(conn.pending)
        except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError):
            return
        except ssl.SSLWantReadError:  # TLS needs the peer's data first: wait for it, not for a writable socket
            self._selector.modify(conn.sock, selectors.EVENT_READ, conn)
            return
        except OSError:
            self._close(conn, "reset")
            return
        conn.pending = conn.pending[sent:]
        if conn.pending:
            self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
            return
        conn.write_started = None
        if conn.close_after or self._stopping:
            self._close(conn, "done")
            return
        now = time.monotonic()
        conn.since = now
        conn.request_started = now if _unparsed(conn) else None
        self._selector.modify(conn.sock, selectors.EVENT_READ, conn)
        self._queue_if_ready(conn)
        self._read_tls_buffer(conn)

    def _dispatch(self, conn: _Connection) -> None:
        conn.busy = True
        self._selector.unregister(conn.sock)
        assert self._pool is not None
        try:
            self._pool.submit(self._answer, conn)
        except RuntimeError:  # the pool is shutting down
            self._close(conn, "stopped", unregister=False)

    def _take_back(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass
        while self._returned:
            conn = self._returned.popleft()
            if conn.sock.fileno() < 0:
                self._close(conn, "done", unregister=False)
            elif self._stopping:
                self._close(conn, "stopped", unregister=False)
            else:
                conn.busy = False
                if conn.pending:  # the rest of an answer: sent when the socket takes it, nothing read meanwhile
                    self._selector.register(conn.sock, selectors.EVENT_WRITE, conn)
                else:
                    self._selector.register(conn.sock, selectors.EVENT_READ, conn)
                    self._queue_if_ready(conn)  # requests left after a worker's turn
                    self._read_tls_buffer(conn)

    def _sweep(self, now: float) -> None:
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._selector.register(self._listener, selectors.EVENT_READ, _LISTENER)
        idle_limit = self.limits.idle_timeout_seconds
        request_limit = self.limits.request_timeout_seconds
        write_limit = self.limits.write_timeout_seconds
        for conn in list(self._conns):
            if conn.busy:
                continue
            if conn.write_started is not None:
                if now - conn.write_started > write_limit:
                    self._close(conn, "write_timeout")
            elif conn.request_started is not None:
                if now - conn.request_started > request_limit:
                    self._close(conn, "request_timeout")
            elif now - conn.since > idle_limit:
                self._close(conn, "idle_timeout")

    def _close(self, conn: _Connection, reason: str, *, unregister: bool = True) -> None:
        if unregister and not conn.busy:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(conn.sock)
        self._conns.discard(conn)
        with contextlib.suppress(OSError):
            conn.sock.close()
        self._count(f"closed_{reason}")

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _log_once(self, message: str) -> None:
        if message not in self._logged and len(self._logged) < 100:
            self._logged.add(message)
            log.warning("%s", message)

    # -- worker threads ------------------------------------------------------------------------------
    def _answer(self, conn: _Connection) -> None:
        """Answer up to `pipelined_per_turn` complete requests h11 holds, then hand the connection back
        (the selector thread queues it again if requests are left, or waits for the socket to take the rest
        of an answer: `pending`) or close it. A worker never waits for a client to read."""
        keep_alive = True
        try:
            for _ in range(self.limits.pipelined_per_turn):
                request = self._take_request(conn)
                if request is None:
                    break
                data, keep_alive = self._respond(conn, request)
                if not self._send(conn, data, keep_alive):
                    break  # the rest waits on the selector thread for the socket
                if not keep_alive:
                    break
                conn.request_started = time.monotonic() if _unparsed(conn) else None
                conn.since = time.monotonic()
        except (OSError, ValueError) as exc:  # a client gone, a TLS error
            self._count("write_failed")
            log.debug("answering %s failed: %s", conn.peer, exc)
            keep_alive, conn.pending = False, b""
        except Exception as exc:  # never let a worker die silently
            self._log_once(f"answering a request failed: {type(exc).__name__}: {exc}")
            keep_alive, conn.pending = False, b""
        if (not keep_alive and not conn.pending) or self._stopping:
            with contextlib.suppress(OSError):
                conn.sock.close()  # now, so the client sees the end at once; the selector thread forgets it
        self._returned.append(conn)
        self._wake()

    def _send(self, conn: _Connection, data: bytes, keep_alive: bool) -> bool:
        """Write what the socket takes now, without waiting; False: the rest is left in `pending` (and the
        connection closes after it unless `keep_alive`), for the selector thread to send when it can."""
        view = memoryview(data)
        while view:
            try:
                sent = conn.sock.send(view)
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                break
            view = view[sent:]
        if not view:
            return True
        conn.pending, conn.close_after, conn.write_started = bytes(view), not keep_alive, time.monotonic()
        self._count("partial_writes")
        return False

    def _take_request(self, conn: _Connection) -> Request | BadRequest | None:
        """The request parsed when the connection was queued, else the next one h11 has complete (None: none)."""
        request, conn.request = conn.request, None
        if request is None:
            try:
                request = next_request(conn.http)
            except BadRequest as exc:
                request = exc
        return request

    def _respond(self, conn: _Connection, request: Request | BadRequest) -> tuple[bytes, bool]:
        """The response to `request`, framed by the connection's h11, and whether the connection stays open."""
        headers = self.web_config.headers
        http = conn.http
        if isinstance(request, BadRequest):
            self._count("bad_requests")
            data = frame_response(http, request.status, f"{request}\n".encode(), _TEXT, close=True,
                                  head_only=request.head_only, extra_headers=headers)
            return data, False
        close = self._stopping
        head_only = request.method == "HEAD"
        if request.method not in ("GET", "HEAD"):
            data = frame_response(http, 405, b"only GET and HEAD are served\n", _TEXT, close=close,
                                  extra_headers=(("Allow", "GET, HEAD"), *headers))
            return data, keeps_alive(http)
        auth = self.web_config.basic_auth
        if auth is not None and not auth.check(request.authorization):
            self._count("unauthorized")
            data = frame_response(http, 401, b"Unauthorized\n", _TEXT, head_only=head_only, close=close,
                                  extra_headers=(("WWW-Authenticate", 'Basic realm="memtel"'), *headers))
            return data, keeps_alive(http)
        status, body, content_type = self._route(request.path, conn.received_at)
        self._count("requests")
        data = frame_response(http, status, body, content_type, head_only=head_only, close=close,
                              extra_headers=headers)
        return data, keeps_alive(http)

    def _route(self, path: str, arrived: float) -> tuple[int, bytes, str]:
        if path == "/metrics":
            try:
                return 200, self._collection.body(arrived), CONTENT_TYPE_LATEST
            except Exception as exc:  # collectors are isolated by their wrapper; this is a last guard
                log.exception("rendering /metrics failed")
                return 500, f"rendering metrics failed: {exc}\n".encode(), _TEXT
        if path == "/healthz" and self.health is not None:
            return 200, json.dumps(self.health()).encode() + b"\n", "application/json"
        if path == "/":
            pages = "/metrics and /healthz" if self.health is not None else "/metrics"
            return 200, f"{self.name}: see {pages}\n".encode(), _TEXT
        return 404, b"not found: try /metrics\n", _TEXT


def _unparsed(conn: _Connection) -> int:
    """Bytes read from the connection that h11 holds unparsed (part of a next request, or pipelined ones)."""
    return len(conn.http.trailing_data[0])


def _bind(host: str, port: int, backlog: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot listen on {format_listen(host, port)}: {exc.strerror} "
                          "(expected an address or host name of this machine)") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host in ("::", ""):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # [::] serves IPv4 too
        sock.bind(address)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise listen_failed(host, port, exc) from None
    sock.setblocking(False)
    return sock


def listen_failed(host: str, port: int, exc: OSError) -> ConfigError | ListenError:
    """The one error of every server command whose address cannot be bound (the exporter, the guard, the lab):
    one line with HOST:PORT and the system's reason, never a library's wording (asyncio quotes its address
    tuple). An address that is not this machine's is bad input (ConfigError, exit 2); one in use or refused is
    ListenError (exit 1), as docs/cli.md's table of exit codes says."""
    where = format_listen(host, port)
    if isinstance(exc, socket.gaierror):   # its errno is the resolver's (negative), not the system's
        return ConfigError(f"cannot listen on {where}: {exc.strerror} (expected an address or host name of this "
                           "machine)")
    reason = os.strerror(exc.errno) if exc.errno else (exc.strerror or str(exc))
    if exc.errno == errno.EADDRNOTAVAIL:
        return ConfigError(f"cannot listen on {where}: {reason} (the address is not one of this machine's)")
    hint = ""
    if exc.errno == errno.EADDRINUSE:
        hint = " (another program is using it: stop it or choose another port)"
    elif exc.errno == errno.EACCES:
        hint = " (ports below 1024 need root or CAP_NET_BIND_SERVICE)"
    return ListenError(f"cannot listen on {where}: {reason}{hint}")


def _bounded_connections(wanted: int) -> int:
    """`wanted`, or fewer if the open-file limit would not leave room for the process's own files."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    allowed = max(8, soft - _FD_RESERVE)
    if allowed < wanted:
        log.warning("open-file limit %d: serving at most %d connections at once (raise LimitNOFILE= for more)",
                    soft, allowed)
    return min(wanted, allowed)


__all__ = ["ListenError", "MetricsServer", "ServerLimits", "listen_failed"]
