"""The guard's reverse proxy: size each completion's prompt, refuse what would not fit, pass the rest through.

One asyncio event loop serves every client connection and the hooks' scrapes; a request costs no
thread. `/v1/completions` and `/v1/chat/completions` are sized (telemetry/guard/prompt.py) and decided
against the limit in force (telemetry/guard/limit.py): admitted requests go upstream unchanged and hold
their tokens until the upstream sends the first byte of the response's body (the prefill is over); refused
ones get an OpenAI-style error (telemetry/guard/refusal.py): 400 with `x-should-retry: false` for a prompt no
retry can fit (over the engine's max-model-len, or over what the deployment could take at best), 503 with
`Retry-After` and `x-should-retry: true` for one that does not fit now. The paths in `PASS_THROUGH` go upstream
unchanged. Any other path is answered 404 here: an endpoint that runs a prefill the guard does not size
(`/v1/embeddings`, SGLang's `/generate`) must not reach the engine around it.

HTTP/1.1 on both sides goes through h11 (telemetry/guard/http.py): a request is read whole, checked for
framing the upstream could read otherwise (`_check_framing`), decided, and sent upstream re-framed.
Bounds (`GuardLimits`, docs/guard.md "Limits"): a number of client connections (past it, the one that has
waited longest for its next request or for the rest of its request is closed), idle, read, request and send
timeouts, a bounded head and body.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from telemetry.catalogue import metrics as catalogue
from telemetry.catalogue.fields import (
    GUARD_BAD_REQUEST,
    GUARD_BLIND,
    GUARD_NOT_FORWARDED,
    GUARD_UPSTREAM_ERROR,
    GUARD_UPSTREAM_UNAVAILABLE,
)
from telemetry.errors import ConfigError
from telemetry.guard.admission import admit
from telemetry.guard.at_best import AtBest, deployment_at_best
from telemetry.guard.http import (
    Channel,
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
from telemetry.guard.limit import LimitTracker, fetch_metrics
from telemetry.guard.metrics import GuardMetrics
from telemetry.guard.prompt import CHAT_COMPLETIONS, COMPLETIONS, PromptError, PromptSize, measure, parse_body
from telemetry.guard.queue import ClientLeft, GuardQueue, QueueFull, needed, transient
from telemetry.guard.refusal import MODELS_PATH, RETRY_AFTER_S, ContextLength, Refusal, behind, error_body
from telemetry.url import Endpoint

log = logging.getLogger("memtel.guard")

GUARDED = (COMPLETIONS, CHAT_COMPLETIONS)
# Paths that run no prefill, passed through unchanged (GET also answers HEAD).
PASS_THROUGH = {"GET": ("/v1/models", "/health", "/ping", "/version", "/metrics", "/get_model_info"),
                "POST": ("/tokenize", "/detokenize")}
MODEL_PATH_PREFIX = "/v1/models/"
WHEN_BLIND = ("admit", "reject")
_JSON = "application/json"
LINGER_S = 2.0
LINGER_BYTES = 128 << 20
# Bodies larger than this are parsed and counted in a worker thread, so a 64 MiB body (most of a second of
# JSON parsing) does not stop the event loop that serves every other connection and stream for that long.
# Smaller ones, a 1M-token prompt included (4 to 8 MB, 30 to 60 ms here), are parsed on the loop: handing
# them to a thread made the 1M-token refusal about 25 ms slower at the median (BENCHMARKS.md, "memtel guard").
INLINE_PARSE_BYTES = 8 << 20
BLIND_ROOM = 1 << 62  # the queue's room while blind with --when-blind admit: every waiter is decided again
# What a body that cannot be parsed raises besides PromptError: a 5,000-digit integer is a ValueError of
# int()'s digit limit, deep nesting a RecursionError. Each is the client's error: a 400, never a traceback.
_BODY_ERRORS = (PromptError, ValueError, TypeError, RecursionError, MemoryError)


@dataclass(frozen=True)
class GuardLimits:
    max_connections: int = 256
    idle_timeout_s: float = 90.0  # a client connection without a request
    request_timeout_s: float = 60.0  # from a request's first byte to its body's last (a 64 MiB body on a slow link)
    read_timeout_s: float = 10.0  # inside a request, the longest wait for the client's next bytes
    send_timeout_s: float = 60.0  # the longest a client may take nothing of an answer before it is dropped
    max_head_bytes: int = 16384
    max_body_bytes: int = 64 << 20  # a 1M-token prompt is 4 to 8 MB of JSON
    connect_timeout_s: float = 10.0  # to the upstream
    max_idle_upstream: int = 32  # kept-alive upstream connections
    queue_s: float = 0.0  # the longest a prompt that does not fit now waits for room (0: 503 at once)
    max_queued: int = 32  # waiting at most (each holds its body once: at most max_body_bytes)


class _UpstreamPool:
    """Kept-alive connections to the upstream, each reused only after an exchange h11 saw finish cleanly."""

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


class Replica:
    """One engine behind the guard: its upstream, its ranks' limit, its connections, its health."""

    def __init__(self, upstream: Endpoint, tracker: LimitTracker, limits: GuardLimits) -> None:
        self.upstream = upstream
        self.tracker = tracker
        self.name = upstream.url
        self.pool = _UpstreamPool(upstream, limits)
        self.context = ContextLength()  # the engine's max-model-len, read when a prompt is over the limit
        self.healthy = True  # its /health answered 200 last time (polled only with two or more replicas)
        self.health_error: str | None = None


class _Client:
    __slots__ = ("channel", "task", "waiting_since")

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        # Since when it has been waiting for its next request or reading one (head or body); None while the
        # guard handles a request it read whole. The one waiting longest is evicted first.
        self.waiting_since: float | None = time.monotonic()
        self.task: asyncio.Task[None] | None = None


_Refusal = Refusal  # status, OpenAI error body, Retry-After and x-should-retry (refusal.py)


class _Unreachable(Exception):
    """The chosen replica refused the connection (str: why): nothing was sent to it, so another may take it."""


class GuardProxy:
    def __init__(self, upstream: Endpoint, tracker: LimitTracker, metrics: GuardMetrics, *,
                 when_blind: str = "admit", limits: GuardLimits | None = None,
                 replicas: list[tuple[Endpoint, LimitTracker]] | None = None) -> None:
        """upstream, tracker: the one replica; or `replicas` (upstream, tracker) each, the first standing for
        `upstream` and `tracker` then."""
        if when_blind not in WHEN_BLIND:
            raise ConfigError(f"--when-blind: expected one of {', '.join(WHEN_BLIND)}, got {when_blind!r}")
        self.metrics = metrics
        self.when_blind = when_blind
        self.limits = limits or GuardLimits()
        self.replicas = [Replica(u, t, self.limits) for u, t in (replicas or [(upstream, tracker)])]
        first = self.replicas[0]
        self.upstream, self.tracker, self._pool, self.context = first.upstream, first.tracker, first.pool, first.context
        self._turn = 0  # breaks ties between replicas with the same room, in turn
        self.queue = GuardQueue(self.limits.queue_s, self.limits.max_queued, metrics, self._rooms,
                                self._at_best_tokens)
        for replica in self.replicas:
            replica.tracker.subscribe(self.queue.kick)
        self._clients: set[_Client] = set()
        self._refusing: set[asyncio.Future[None]] = set()  # answering 503 to connections past the bound
        self._server: asyncio.base_events.Server | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------
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
        for replica in self.replicas:
            replica.pool.close()
        await asyncio.sleep(0)  # the closed transports' connection_lost (which closes their sockets) runs now

    @property
    def open_connections(self) -> int:
        return len(self._clients)

    # -- one client connection ------------------------------------------------------------------------
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
                await self._handle(request, body, side, started)
                if not side.next_cycle():
                    break
        except HttpError as exc:
            self.metrics.count(catalogue.GUARD_REJECTED, "bad_request")
            if side.answering:
                await self._answer(side, exc.status, error_body(GUARD_BAD_REQUEST, str(exc), exc.status), close=True)
            # A lingering close: read (and drop) what the client is still sending for a moment, so it reads
            # the answer instead of a reset (RFC 9112 section 9.6).
            with contextlib.suppress(ConnectionError, OSError):
                await client.channel.discard(LINGER_BYTES, LINGER_S)
        except asyncio.TimeoutError:
            if side.mid_request and side.answering:  # a slow head or body, not an idle keep-alive connection
                self.metrics.count(catalogue.GUARD_REJECTED, "bad_request")
                message = (f"the request did not arrive in time: at most {limits.read_timeout_s:g} s between its "
                           f"bytes and {limits.request_timeout_s:g} s in all")
                await self._answer(side, 408, error_body(GUARD_BAD_REQUEST, message, 408), close=True)
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

    # -- one request ----------------------------------------------------------------------------------
    async def _handle(self, request: Request, body: bytes, client: ServerSide, started: float) -> None:
        method, path = request.method, request.target.split("?", 1)[0]
        if path in GUARDED:
            if method != "POST":
                return await self._refuse_path(client, 405, f"{path} takes POST, not {method}")
            return await self._guarded(request, path, body, client, started)
        gets = PASS_THROUGH["GET"]
        if path == "/health" and self.when_blind == "reject" and all(r.tracker.limit() is None for r in self.replicas):
            # Refusing every completion while blind, the service is down for clients: say so where load
            # balancers and the harness look (and a guard that has not seen its first forecast is not ready).
            self.metrics.count(catalogue.GUARD_REJECTED, "blind")
            message = f"memtel guard: blind (--when-blind reject): {self._why_blind()}"
            return await self._answer(client, 503, error_body(GUARD_BLIND, message, 503),
                                      (("Retry-After", str(RETRY_AFTER_S["blind"])),))
        if (method in ("GET", "HEAD") and (path in gets or path.startswith(MODEL_PATH_PREFIX))) or \
                (method == "POST" and path in PASS_THROUGH["POST"]):
            self.metrics.count(catalogue.GUARD_PASSED_THROUGH)
            replica = next((r for r in self.replicas if r.healthy), self.replicas[0])
            return await self._forward(replica, request, body, client, started, None)
        known = ", ".join([*GUARDED, *gets, *PASS_THROUGH["POST"]])
        return await self._refuse_path(client, 404, f"{method} {path[:100]} is not forwarded by the memtel guard "
                                                    f"(it forwards {known})")

    async def _refuse_path(self, client: ServerSide, status: int, message: str) -> None:
        self.metrics.count(catalogue.GUARD_REJECTED, "not_forwarded")
        await self._answer(client, status, error_body(GUARD_NOT_FORWARDED, message, status))

    async def _guarded(self, request: Request, path: str, raw: bytes, client: ServerSide, started: float) -> None:
        try:
            if len(raw) > INLINE_PARSE_BYTES:  # a long prompt takes tens of ms to parse: not on the event loop
                size = await asyncio.to_thread(_measure_all, path, raw)
            else:
                size = measure(path, parse_body(raw))
        except _BODY_ERRORS as exc:
            self.metrics.count(catalogue.GUARD_REJECTED, "bad_request")
            await self._answer(client, 400, error_body(GUARD_BAD_REQUEST, _body_error(exc), 400))
            return
        # With several replicas, one that cannot be reached (nothing was sent to it) leaves the pool at once and the
        # prompt is decided again among the others: it goes where it fits, waits, or gets the transient 503.
        for _attempt in range(len(self.replicas)):
            try:
                replica, held, counted_by = await self._admit(request, size, client)
            except _Refusal as refusal:
                if refusal.counted_as is not None:
                    self.metrics.count(catalogue.GUARD_REJECTED, refusal.counted_as)
                self.metrics.observe_added(time.perf_counter() - started)
                await self._answer(client, refusal.status, refusal.body, refusal.headers)
                return
            self.metrics.count(catalogue.GUARD_ADMITTED, path, counted_by)
            released = False

            def release(replica: Replica = replica, held: int = held) -> None:
                nonlocal released
                if not released:
                    released = True
                    replica.tracker.release(held)

            try:
                await self._forward(replica, request, raw, client, started, release,
                                    unreachable_raises=len(self.replicas) > 1)
                return
            except _Unreachable as down:
                self._leave_pool(replica, str(down))
            finally:
                release()
        none_left = self._no_replica()  # every replica was tried and refused the connection
        self.metrics.count(catalogue.GUARD_REJECTED, "no_replica")
        await self._answer(client, none_left.status, none_left.body, none_left.headers)

    async def _admit(self, request: Request, size: PromptSize, client: ServerSide) -> tuple[Replica, int, str]:
        """Decide now, or queue a transient refusal when --queue-s is set: (replica, tokens held, counted by)."""
        try:
            replica, held, counted_by = await self._decide(request, size)
            if self.queue.enabled and self.queue.blocked() and (limit := replica.tracker.published) is not None:
                replica.tracker.release(held)  # the queue's order rule: behind the head that waited its turn
                raise behind(held, counted_by, limit)
        except _Refusal as refusal:
            if not (self.queue.enabled and transient(refusal)):
                raise
            replica, held, counted_by = await self._wait(request, size, refusal, client)
        return replica, held, counted_by

    def _leave_pool(self, replica: Replica, reason: str) -> None:
        """A replica that refused a connection or failed its /health poll leaves the pool now; a /health poll
        answered 200 brings it back."""
        if replica.healthy:
            log.warning("memtel guard: replica %s leaves the pool: %s", replica.name, reason)
        replica.healthy, replica.health_error = False, reason

    async def _wait(self, request: Request, size: PromptSize, refusal: _Refusal,
                    client: ServerSide) -> tuple[Replica, int, str]:
        """Queue a prompt refused as transient until it is admitted (queue.py); the last refusal at the deadline,
        the first when the queue is full; ConnectionResetError when the client leaves (its connection closes)."""
        waited = time.monotonic()
        try:
            return await self.queue.wait(refusal, needed(refusal, 0), client.channel.gone(),
                                         lambda: self._decide(request, size))
        except QueueFull:
            refusal.body["error"]["queue"] = f"full: {self.queue.max_queued} requests wait (--max-queued)"
            raise refusal from None
        except ClientLeft:
            raise ConnectionResetError("the client left while its request waited") from None
        except _Refusal as last:
            if transient(last):
                seconds = time.monotonic() - waited
                last.body["error"]["queued_s"] = round(seconds, 3)
                last.body["error"]["message"] += f" (after waiting {seconds:.1f} s in the guard's queue)"
            raise

    async def _decide(self, request: Request, size: PromptSize) -> tuple[Replica, int, str]:
        """(the replica, tokens held while the prefill runs, how they were counted); _Refusal to refuse."""
        replica = self._choose()
        auth = [(k, v) for k, v in request.headers if k.lower() in ("authorization", "x-api-key")]
        reasons: list[str] = []
        try:
            held, counted_by = await admit(
                size, replica.tracker, replica.context, tokenize=lambda: self._tokenize(replica, request, size),
                fetch_models=lambda: self._exchange(replica, "GET", MODELS_PATH, auth, b""),
                blind=lambda: self._blind_admit(replica), rejected=reasons.append, at_best=self._at_best)
        except _Refusal as refusal:
            refusal.counted_as = reasons[-1] if reasons else None
            raise
        return replica, held, counted_by

    def _no_replica(self) -> _Refusal:
        why = "; ".join(f"{r.name}: {r.health_error}" for r in self.replicas)
        refusal = _Refusal(503, error_body(GUARD_UPSTREAM_UNAVAILABLE, f"memtel guard: no replica is healthy now "
                                          f"({why})", 503, reason="no_replica", retryable=True),
                           RETRY_AFTER_S["no_replica"], reason="no_replica")
        refusal.counted_as = "no_replica"
        return refusal

    def _choose(self) -> Replica:
        """The replica a completion goes to: of those in the pool (healthy, a fresh limit), the one with the most
        room (ties in turn); none in the pool but some healthy: the first of those (blind: --when-blind decides);
        none healthy: a transient refusal (it may wait)."""
        if len(self.replicas) == 1:
            return self.replicas[0]
        healthy = [r for r in self.replicas if r.healthy]
        if not healthy:
            raise self._no_replica()
        sized = [(limit.tokens, r) for r in healthy if (limit := r.tracker.limit()) is not None]
        if not sized:
            return healthy[0]
        most = max(tokens for tokens, _r in sized)
        tied = [r for tokens, r in sized if tokens == most]
        self._turn += 1
        return tied[self._turn % len(tied)]

    def _rooms(self) -> list[tuple[int, int]]:
        """The tokens each replica in the pool can take now and with nothing in prefill (the queue's view). Blind
        with --when-blind admit (no replica in the pool, one healthy): room for all, so the waiters are decided
        (and admitted) as a newcomer would be."""
        found = [(limit.tokens, limit.rank_tokens) for r in self.replicas
                 if r.healthy and (limit := r.tracker.limit()) is not None]
        if not found and self.when_blind == "admit" and any(r.healthy for r in self.replicas):
            return [(BLIND_ROOM, BLIND_ROOM)]
        return found

    def _why_blind(self) -> str:
        if len(self.replicas) == 1:
            return self.tracker.why_blind()
        return "; ".join(f"{r.name}: {r.tracker.why_blind()}" for r in self.replicas)

    async def watch_health(self, poll_s: float, timeout_s: float) -> None:
        """Poll every replica's /health every `poll_s`: one that fails leaves the pool, and comes back when it
        answers 200 again (the queue is woken then)."""
        targets = [r.upstream.at(r.upstream.port, "/health") for r in self.replicas]

        async def one(replica: Replica, target: Endpoint) -> None:
            try:
                await fetch_metrics(target, timeout_s)
            except (OSError, asyncio.TimeoutError, UpstreamError) as exc:
                error: str | None = f"/health: {type(exc).__name__}: {exc}"[:200]
            else:
                error = None
            if error is not None:
                self._leave_pool(replica, error)
                return
            if not replica.healthy:
                log.warning("memtel guard: replica %s is healthy again: back in the pool", replica.name)
            replica.healthy, replica.health_error = True, None
            self.queue.kick()

        while True:
            started = time.monotonic()
            await asyncio.gather(*(one(r, t) for r, t in zip(self.replicas, targets, strict=True)))
            await asyncio.sleep(max(0.0, poll_s - (time.monotonic() - started)))

    def _at_best(self) -> tuple[AtBest | None, str | None]:
        """The deployment's at-best limit (the best replica's, known only where every replica's is) and why not."""
        return deployment_at_best([r.tracker for r in self.replicas])

    def _at_best_tokens(self) -> int | None:
        found = self._at_best()[0]
        return None if found is None else found.tokens

    def _blind_admit(self, replica: Replica) -> tuple[int, str]:
        """Blind: --when-blind decides; an admitted one is in flight on `replica` like any other (its release
        comes with its first byte), so a snapshot meanwhile is not taken for an idle rank's (at_best.py)."""
        decided = self._blind()
        replica.tracker.hold(0)
        return decided

    def _blind(self) -> tuple[int, str]:
        if self.when_blind == "admit":
            self.metrics.count(catalogue.GUARD_BLIND_DECISIONS, "admit")
            return 0, "blind"
        self.metrics.count(catalogue.GUARD_BLIND_DECISIONS, "reject")
        self.metrics.count(catalogue.GUARD_REJECTED, "blind")
        message = ("the memtel guard is blind (no fresh forecast from any hook) and refuses requests until it sees "
                   f"again (--when-blind reject): {self._why_blind()}")
        raise _Refusal(503, error_body(GUARD_BLIND, message, 503, hooks=[h.target.url for r in self.replicas
                                                                         for h in r.tracker.hooks]),
                       RETRY_AFTER_S["blind"])

    async def _tokenize(self, replica: Replica, request: Request, size: PromptSize) -> int:
        """The upstream's exact count; an answer other than a count is relayed to the client as a _Refusal."""
        assert size.tokenize_body is not None
        body = json.dumps(size.tokenize_body, ensure_ascii=False).encode()
        headers = [(k, v) for k, v in request.headers if k.lower() in ("authorization", "x-api-key")]
        headers.append(("Content-Type", _JSON))
        self.metrics.count(catalogue.GUARD_TOKENIZE_CALLS)
        try:
            status, answer = await self._exchange(replica, "POST", "/tokenize", headers, body)
        except (OSError, asyncio.TimeoutError, UpstreamError, HttpError) as exc:
            self.metrics.count(catalogue.GUARD_UPSTREAM_FAILURES, "tokenize")
            raise _Refusal(502, error_body(GUARD_UPSTREAM_UNAVAILABLE, f"memtel guard: the upstream could not "
                                           f"count the prompt's tokens (/tokenize): {exc}", 502), None) from None
        count = None
        if status == 200:
            with contextlib.suppress(ValueError, AttributeError):
                count = json.loads(answer).get("count")
        if status != 200 or not isinstance(count, int) or isinstance(count, bool) or count < 0:
            try:
                relayed = json.loads(answer)
            except ValueError:
                relayed = None
            if not isinstance(relayed, dict):
                relayed = error_body(GUARD_UPSTREAM_ERROR, f"memtel guard: the upstream's /tokenize answered "
                                     f"{status} without a token count", 502)
            raise _Refusal(status if status != 200 else 502, relayed, None)
        return int(count) + size.counted_tokens

    async def _exchange(self, replica: Replica, method: str, path: str, headers: list[tuple[str, str]],
                        body: bytes) -> tuple[int, bytes]:
        """One request to the upstream, its whole answer read (for /tokenize: a few MB at most)."""
        headers = [("Host", replica.upstream.host_port), *headers]
        side, reused = await replica.pool.get()
        try:
            side, response = await self._send(replica, side, reused, method, path, headers, body)
            answer = await side.read_all(self.limits.max_body_bytes)
        except BaseException:
            side.channel.close()
            raise
        replica.pool.put(side)
        return response.status, answer

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

    async def _forward(self, replica: Replica, request: Request, body: bytes, client: ServerSide, started: float,
                       first_byte: Callable[[], None] | None, *, unreachable_raises: bool = False) -> None:
        """Send the request upstream re-framed, relay the answer; the upstream connection is pooled again
        only when the whole answer was read and reached the client. An upstream that cannot be reached is a 502,
        or _Unreachable (nothing sent anywhere yet) with `unreachable_raises`."""
        headers = [("Host", replica.upstream.host_port), *end_to_end(request.headers)]
        try:
            side, reused = await replica.pool.get()
        except (OSError, asyncio.TimeoutError) as exc:
            self.metrics.count(catalogue.GUARD_UPSTREAM_FAILURES, "connect")
            reason = getattr(exc, "strerror", None) or type(exc).__name__
            if unreachable_raises:
                raise _Unreachable(f"cannot connect: {reason}") from None
            await self._answer(client, 502, error_body(GUARD_UPSTREAM_UNAVAILABLE,
                                                       f"memtel guard: cannot reach the upstream {replica.name}: "
                                                       f"{reason}", 502))
            return
        self.metrics.count(catalogue.GUARD_REPLICA_FORWARDED, replica.name)
        self.metrics.observe_added(time.perf_counter() - started)
        try:
            side, response = await self._send(replica, side, reused, request.method, request.target, headers, body)
        except (OSError, asyncio.TimeoutError, UpstreamError, HttpError) as exc:
            side.channel.close()
            self.metrics.count(catalogue.GUARD_UPSTREAM_FAILURES, "request")
            await self._answer(client, 502, error_body(GUARD_UPSTREAM_UNAVAILABLE,
                                                       f"memtel guard: the upstream {replica.name} did not "
                                                       f"answer: {type(exc).__name__}: {exc}", 502), close=True)
            return
        send_s = self.limits.send_timeout_s
        whole = False
        try:
            client.start(response.status, response.reason, response.relayed_headers())
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

    async def _answer(self, client: ServerSide, status: int, payload: dict[str, Any],
                      extra: tuple[tuple[str, str], ...] = (), *, close: bool = False) -> None:
        data = json.dumps(payload).encode() + b"\n"
        headers = [("Content-Type", _JSON), *extra]
        if close:
            headers.append(("Connection", "close"))
        with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError, HttpError):
            await client.respond(status, headers, data, self.limits.send_timeout_s)


def _measure_all(path: str, raw: bytes) -> PromptSize:
    size = measure(path, parse_body(raw))
    _ = size.least_tokens  # counted here too, off the event loop (it is cached on the object)
    return size


def _body_error(exc: BaseException) -> str:
    """One line for a body that cannot be parsed: PromptError's own, else what the parser said."""
    if isinstance(exc, PromptError):
        return str(exc)
    what = str(exc).splitlines()[0].split("; use sys.")[0][:160] if str(exc) else type(exc).__name__
    return f"malformed JSON in the request body: {what}; expected a JSON object"  # int()'s advice is not the client's


__all__ = ["GUARDED", "PASS_THROUGH", "WHEN_BLIND", "GuardLimits", "GuardProxy", "Replica", "error_body"]
