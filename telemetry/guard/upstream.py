"""The guard's upstream client: kept-alive connections to each replica, one exchange read whole (/tokenize,
/v1/models), and a request forwarded with its answer relayed to the client as it arrives.

A connection is reused only after an exchange h11 saw finish cleanly (Envoy's rule); one the upstream closed while
idle is retried once on a fresh one. A forwarded request whose client goes away closes its upstream connection, so
the engine aborts it: while its answer streams, and before the answer's head (a non-streamed completion's comes at
its end).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import Callable
from typing import Any

from telemetry.admission.pool import Replica as CoreReplica
from telemetry.admission.refusal import error_body
from telemetry.catalogue import metrics as catalogue
from telemetry.catalogue.fields import GUARD_UPSTREAM_UNAVAILABLE
from telemetry.guard.bounds import GuardLimits
from telemetry.guard.http import (
    ClientSide,
    HttpError,
    Request,
    Response,
    ServerSide,
    UpstreamClosed,
    UpstreamError,
    end_to_end,
    open_channel,
)
from telemetry.guard.limit import LimitTracker
from telemetry.guard.metrics import GuardMetrics
from telemetry.url import Endpoint

JSON = "application/json"


class UpstreamPool:
    """Kept-alive connections to one upstream, each reused only after an exchange h11 saw finish cleanly."""

    def __init__(self, upstream: Endpoint, limits: GuardLimits) -> None:
        self.upstream = upstream
        self.limits = limits
        self._idle: list[ClientSide] = []
        self._ssl = ssl.create_default_context() if upstream.tls else None

    async def get(self) -> tuple[ClientSide, bool]:
        """A connection, and whether it was kept alive from an earlier exchange."""
        while self._idle:
            side = self._idle.pop()
            side.channel.idle = False
            if not side.channel.closed:  # a byte or EOF while it was idle has closed it
                return side, True
        return await self.connect(), False

    async def connect(self) -> ClientSide:
        channel = await open_channel(self.upstream.host, self.upstream.port, self._ssl, self.limits.connect_timeout_s)
        return ClientSide(channel, self.limits.max_head_bytes)

    def put(self, side: ClientSide) -> None:
        """Keep `side` for the next exchange if h11 says its last one ended cleanly; else close it."""
        if len(self._idle) < self.limits.max_idle_upstream and side.reusable():
            side.channel.idle = True
            self._idle.append(side)
        else:
            side.channel.close()

    def close(self) -> None:
        for side in self._idle:
            side.channel.close()
        self._idle.clear()


class Replica(CoreReplica):
    """One engine behind the guard: the core's replica (readings, health, max-model-len), its upstream and its
    kept-alive connections."""

    readings: LimitTracker

    def __init__(self, upstream: Endpoint, tracker: LimitTracker, limits: GuardLimits) -> None:
        super().__init__(upstream.url, tracker)
        self.upstream = upstream
        self.tracker = tracker
        self.pool = UpstreamPool(upstream, limits)
        self.models_reading: asyncio.Future[None] | None = None  # one /v1/models read at a time


class Unreachable(Exception):
    """The chosen replica refused the connection (str: why): nothing was sent to it, so another may take it."""


async def answer(client: ServerSide, status: int, payload: dict[str, Any], send_timeout_s: float,
                 extra: tuple[tuple[str, str], ...] = (), *, close: bool = False) -> None:
    """Answer the client with a JSON body (a refusal or an error); a client gone meanwhile is no error."""
    data = json.dumps(payload).encode() + b"\n"
    headers = [("Content-Type", JSON), *extra]
    if close:
        headers.append(("Connection", "close"))
    with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError, HttpError):
        await client.respond(status, headers, data, send_timeout_s)


class UpstreamClient:
    def __init__(self, limits: GuardLimits, metrics: GuardMetrics) -> None:
        self.limits = limits
        self.metrics = metrics

    async def exchange(self, replica: Replica, method: str, path: str, headers: list[tuple[str, str]],
                       body: bytes) -> tuple[int, bytes]:
        """One request to the upstream, its whole answer read (for /tokenize: a few MB at most)."""
        headers = [("Host", replica.upstream.host_port), *headers]
        side, reused = await replica.pool.get()
        try:
            side, response = await self._send(replica, side, reused, method, path, headers, body)
            data = await side.read_all(self.limits.max_body_bytes)
        except BaseException:
            side.channel.close()
            raise
        replica.pool.put(side)
        return response.status, data

    async def _send(self, replica: Replica, side: ClientSide, reused: bool, method: str, target: str,
                    headers: list[tuple[str, str]], body: bytes) -> tuple[ClientSide, Response]:
        """Send the request and read the answer's head; on a kept-alive connection the upstream had closed,
        once more on a fresh one. (the connection used, the response head)"""
        try:
            await side.send_request(method, target, headers, body, self.limits.send_timeout_s)
            return side, await side.response()
        except (UpstreamClosed, ConnectionError):
            side.channel.close()
            if not reused:
                raise
        side = await replica.pool.connect()
        try:
            await side.send_request(method, target, headers, body, self.limits.send_timeout_s)
            return side, await side.response()
        except BaseException:
            side.channel.close()
            raise

    async def forward(self, replica: Replica, request: Request, body: bytes, client: ServerSide, started: float,
                      first_byte: Callable[[], None] | None, *, unreachable_raises: bool = False,
                      extra: tuple[tuple[str, str], ...] = ()) -> None:
        """Send the request upstream re-framed, relay the answer; the upstream connection is pooled again
        only when the whole answer was read and reached the client. An upstream that cannot be reached is a 502,
        or Unreachable (nothing sent anywhere yet) with `unreachable_raises`. `extra`: headers added to the answer."""
        send_s = self.limits.send_timeout_s
        headers = [("Host", replica.upstream.host_port), *end_to_end(request.headers)]
        try:
            side, reused = await replica.pool.get()
        except (OSError, asyncio.TimeoutError) as exc:
            self.metrics.count(catalogue.GUARD_UPSTREAM_FAILURES, "connect")
            reason = getattr(exc, "strerror", None) or type(exc).__name__
            if unreachable_raises:
                raise Unreachable(f"cannot connect: {reason}") from None
            await answer(client, 502, error_body(GUARD_UPSTREAM_UNAVAILABLE, f"memtel guard: cannot reach the "
                                                 f"upstream {replica.name}: {reason}", 502), send_s)
            return
        self.metrics.count(catalogue.GUARD_REPLICA_FORWARDED, replica.name)
        self.metrics.observe_added(time.perf_counter() - started)
        # Until the answer's head, watch the client too: a non-streamed completion is answered whole at its end, so
        # a client that leaves meanwhile is seen only here. The upstream connection is then closed: the engine
        # aborts the request (vLLM does on a closed connection) and the caller releases its hold. (A callback on
        # the client's gone() rather than a second task: nothing more per request on the hot path.)
        task = asyncio.current_task()
        waiting = True
        left = False

        def client_left(_gone: object) -> None:
            nonlocal left
            if waiting and task is not None:
                left = True
                task.cancel()

        gone = client.channel.gone()
        gone.add_done_callback(client_left)
        try:
            side, response = await self._send(replica, side, reused, request.method, request.target, headers, body)
        except asyncio.CancelledError:
            side.channel.close()
            if not left or task is None:
                raise
            uncancel = getattr(task, "uncancel", None)  # Python 3.11+: the cancel was ours, taken back
            if uncancel is not None:
                uncancel()
            return  # the client left: nobody to answer
        except (OSError, asyncio.TimeoutError, UpstreamError, HttpError) as exc:
            waiting = False
            side.channel.close()
            self.metrics.count(catalogue.GUARD_UPSTREAM_FAILURES, "request")
            await answer(client, 502, error_body(GUARD_UPSTREAM_UNAVAILABLE, f"memtel guard: the upstream "
                                                 f"{replica.name} did not answer: {type(exc).__name__}: {exc}", 502),
                         send_s, close=True)
            return
        finally:
            waiting = False
            gone.remove_done_callback(client_left)
        whole = False
        try:
            client.start(response.status, response.reason, [*response.relayed_headers(), *extra])
            async for piece in side.body():
                if first_byte is not None:
                    first_byte()
                    first_byte = None
                await client.send(piece, send_s)
            await client.end(send_s)
            whole = True
        except UpstreamError:
            # Mid-body: the head is out, so the client learns of it by the connection closing.
            self.metrics.count(catalogue.GUARD_UPSTREAM_FAILURES, "body")
        except (OSError, asyncio.TimeoutError, HttpError):
            pass  # the client went away (or took nothing for send_timeout_s): closing upstream aborts the request
        finally:
            if whole:
                replica.pool.put(side)
            else:
                side.channel.close()  # a streaming engine aborts the request when its connection closes


__all__ = ["JSON", "Replica", "Unreachable", "UpstreamClient", "UpstreamPool", "answer"]
