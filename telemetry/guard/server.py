"""The guard's connection server: client connections accepted and bounded, each request read whole through h11,
checked for framing the upstream could read otherwise, and handed to the guard's handler.

Bounds (`GuardLimits`, docs/guard.md "Limits"): a number of client connections (past it, the one that has waited
longest for its next request or for the rest of its request is closed), idle, read, request and send timeouts, a
bounded head and body, at most `max_pipelined` requests answered back to back from what a client had already sent
(the event loop served in between: each buffered request yields to the other connections first). A connection that
fails never stops the guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from telemetry.admission.refusal import error_body
from telemetry.catalogue import metrics as catalogue
from telemetry.catalogue.fields import GUARD_BAD_REQUEST
from telemetry.guard.bounds import GuardLimits
from telemetry.guard.http import Channel, HttpError, Request, ServerSide
from telemetry.guard.metrics import GuardMetrics
from telemetry.guard.upstream import answer

log = logging.getLogger("memtel.guard")

LINGER_S = 2.0
LINGER_BYTES = 128 << 20

Handler = Callable[[Request, bytes, ServerSide, float], Awaitable[None]]


class _Client:
    __slots__ = ("channel", "task", "waiting_since")

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        # Since when it has been waiting for its next request or reading one (head or body); None while the
        # guard handles a request it read whole. The one waiting longest is evicted first.
        self.waiting_since: float | None = time.monotonic()
        self.task: asyncio.Task[None] | None = None


class ConnectionServer:
    def __init__(self, limits: GuardLimits, metrics: GuardMetrics, handle: Handler) -> None:
        """handle(request, body, side, started): answer one request read whole (started: perf_counter at its head)."""
        self.limits = limits
        self.metrics = metrics
        self.handle = handle
        self._clients: set[_Client] = set()
        self._refusing: set[asyncio.Future[None]] = set()  # answering 503 to connections past the bound
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen; the port actually bound (port 0 picks one)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Channel(self._accept), host, port, backlog=1024,
                                                reuse_address=True)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            tasks = [c.task for c in self._clients if c.task is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    @property
    def open_connections(self) -> int:
        return len(self._clients)

    def _accept(self, channel: Channel) -> None:
        if len(self._clients) >= self.limits.max_connections and not self._evict_waiting():
            self.metrics.count(catalogue.GUARD_CONNECTIONS, "refused")
            task = asyncio.ensure_future(self._too_many(channel))
            self._refusing.add(task)
            task.add_done_callback(self._refusing.discard)
            return
        client = _Client(channel)
        self._clients.add(client)
        client.task = asyncio.ensure_future(self._serve_client(client))

    async def _too_many(self, channel: Channel) -> None:
        side = ServerSide(channel, self.limits.max_head_bytes)
        with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError, HttpError):
            await side.respond(503, [("Content-Type", "text/plain"), ("Connection", "close")],
                               b"memtel guard: too many connections\n", self.limits.send_timeout_s)
        channel.close()

    async def _serve_client(self, client: _Client) -> None:
        limits = self.limits
        side = ServerSide(client.channel, limits.max_head_bytes)
        pipelined = 0  # requests answered back to back from what the client had already sent
        try:
            while True:
                client.waiting_since = time.monotonic()
                request = await side.next_request(limits.idle_timeout_s, limits.read_timeout_s,
                                                  limits.request_timeout_s)
                if request is None:
                    break
                started = time.perf_counter()
                self._check_framing(request)
                body = await side.read_body(limits.max_body_bytes, limits.read_timeout_s, limits.send_timeout_s)
                client.waiting_since = None
                await self.handle(request, body, side, started)
                if not side.next_cycle():
                    break
                if side.pipelined():
                    pipelined += 1
                    if pipelined >= limits.max_pipelined:
                        break  # closed: a client that pipelines without end is not served without end
                    await asyncio.sleep(0)  # the other connections are served between its buffered requests
                else:
                    pipelined = 0
        except HttpError as exc:
            self.metrics.count(catalogue.GUARD_REJECTED, "bad_request")
            if side.answering:
                await answer(side, exc.status, error_body(GUARD_BAD_REQUEST, str(exc), exc.status),
                             limits.send_timeout_s, close=True)
            # A lingering close: read (and drop) what the client is still sending for a moment, so it reads
            # the answer instead of a reset (RFC 9112 section 9.6).
            with contextlib.suppress(ConnectionError, OSError):
                await client.channel.discard(LINGER_BYTES, LINGER_S)
        except asyncio.TimeoutError:
            if side.mid_request and side.answering:  # a slow head or body, not an idle keep-alive connection
                self.metrics.count(catalogue.GUARD_REJECTED, "bad_request")
                message = (f"the request did not arrive in time: at most {limits.read_timeout_s:g} s between its "
                           f"bytes and {limits.request_timeout_s:g} s in all")
                await answer(side, 408, error_body(GUARD_BAD_REQUEST, message, 408), limits.send_timeout_s,
                             close=True)
        except (ConnectionError, OSError):
            pass
        except asyncio.CancelledError:  # the guard is stopping
            pass
        except Exception as exc:  # one bad connection must never stop the guard
            log.exception("memtel guard: a connection failed: %s: %s", type(exc).__name__, exc)
        finally:
            self._clients.discard(client)
            client.channel.close()

    def _evict_waiting(self) -> bool:
        """Close the connection that has waited longest for its next request or for the rest of its request
        (a slow head or a slow body); False when every connection has a request in hand."""
        waiting = [c for c in self._clients if c.waiting_since is not None]
        if not waiting:
            return False
        victim = min(waiting, key=lambda c: c.waiting_since or 0.0)
        self._clients.discard(victim)
        victim.channel.close()
        self.metrics.count(catalogue.GUARD_CONNECTIONS, "evicted")
        return True

    def _check_framing(self, request: Request) -> None:
        """Refuse what an upstream could frame otherwise than h11 did, and bodies the guard would not take."""
        has_length, chunked = request.has("content-length"), request.has("transfer-encoding")
        if has_length and chunked:
            raise HttpError(400, "the request has both Content-Length and Transfer-Encoding; send one")
        length = request.get("content-length")
        if request.method in ("GET", "HEAD") and (chunked or (length and int(length) > 0)):
            raise HttpError(400, f"a {request.method} request must not carry a body")
        if length and int(length) > self.limits.max_body_bytes:
            raise HttpError(413, f"request body of {length} bytes is larger than the guard's limit of "
                                 f"{self.limits.max_body_bytes} bytes")
        encoding = request.get("content-encoding").strip().lower()
        if encoding not in ("", "identity"):
            raise HttpError(415, f"request bodies with Content-Encoding {encoding[:40]!r} are not accepted; "
                                 "send the body uncompressed")


__all__ = ["LINGER_BYTES", "LINGER_S", "ConnectionServer"]
