"""The guard's reverse proxy: size each completion's prompt, refuse what would not fit, pass the rest through.

One asyncio event loop serves every client connection and the hooks' scrapes; a request costs no
thread. `/v1/completions` and `/v1/chat/completions` are sized (telemetry/guard/prompt.py) and decided
against the limit in force (telemetry/guard/limit.py): admitted requests go upstream unchanged and hold
their tokens until the upstream sends the first byte of the response's body (the prefill is over), refused
ones get a 503 with `Retry-After` and an OpenAI-style error body. The paths in `PASS_THROUGH` go upstream
unchanged. Any other path is answered 404 here: an endpoint that runs a prefill the guard does not size
(`/v1/embeddings`, SGLang's `/generate`) must not reach the engine around it.

Limits as the exporter's (telemetry/exporter/server.py): a bounded number of client connections (past
it, the one idle the longest is closed), idle and request timeouts, a bounded head and body.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import ssl
import time
import urllib.parse
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
    GUARD_WOULD_NOT_FIT,
)
from telemetry.errors import ConfigError
from telemetry.guard.http import (
    BodyRelay,
    HttpError,
    Message,
    UpstreamClosed,
    build_request,
    build_response,
    content_length,
    dechunk,
    parse_head,
    read_head,
    relayed_head,
)
from telemetry.guard.limit import Limit, LimitTracker
from telemetry.guard.metrics import GuardMetrics
from telemetry.guard.prompt import CHAT_COMPLETIONS, COMPLETIONS, PromptError, PromptSize, measure, parse_body

log = logging.getLogger("memtel.guard")

GUARDED = (COMPLETIONS, CHAT_COMPLETIONS)
# Paths that run no prefill, passed through unchanged (GET also answers HEAD).
PASS_THROUGH = {"GET": ("/v1/models", "/health", "/ping", "/version", "/metrics", "/get_model_info"),
                "POST": ("/tokenize", "/detokenize")}
MODEL_PATH_PREFIX = "/v1/models/"
WHEN_BLIND = ("admit", "reject")
RETRY_AFTER_S = {"would_not_fit": 10, "in_prefill": 1, "blind": 5}
_JSON = "application/json"
LINGER_S = 2.0
# What a connection's reader buffers before it stops reading the socket: large enough that a 4 MB prompt
# arrives in a few reads, small enough that 256 connections sending garbage heads hold 64 MiB at most.
STREAM_BUFFER_BYTES = 256 * 1024
# Bodies larger than this are parsed and counted in a worker thread, so a 64 MiB body (most of a second of
# JSON parsing) does not stop the event loop that serves every other connection and stream for that long.
# Smaller ones, a 1M-token prompt included (4 to 8 MB, 30 to 60 ms here), are parsed on the loop: handing
# them to a thread made the 1M-token refusal about 25 ms slower at the median (BENCHMARKS.md, "memtel guard").
INLINE_PARSE_BYTES = 8 << 20
LINGER_BYTES = 128 << 20


@dataclass(frozen=True)
class GuardLimits:
    max_connections: int = 256
    idle_timeout_s: float = 90.0  # a client connection without a request
    request_timeout_s: float = 60.0  # from a request's first byte to its body's last (a 64 MiB body on a slow link)
    max_head_bytes: int = 16384
    max_body_bytes: int = 64 << 20  # a 1M-token prompt is 4 to 8 MB of JSON
    connect_timeout_s: float = 10.0  # to the upstream
    max_idle_upstream: int = 32  # kept-alive upstream connections


@dataclass(frozen=True)
class Upstream:
    host: str
    port: int
    tls: bool
    url: str

    @classmethod
    def parse(cls, text: str) -> Upstream:
        expected = "expected the engine's base URL, e.g. http://127.0.0.1:8000"
        try:
            parts = urllib.parse.urlsplit(text.strip())
            port = parts.port
        except ValueError:
            raise ConfigError(f"--upstream: {text[:80]!r} is not a URL; {expected}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") \
                or parts.query or parts.username:
            raise ConfigError(f"--upstream: {text[:80]!r} is not a base URL; {expected}")
        port = port or (443 if parts.scheme == "https" else 80)
        host = parts.hostname
        shown = f"[{host}]" if ":" in host else host
        return cls(host, port, parts.scheme == "https", f"{parts.scheme}://{shown}:{port}")

    @property
    def host_header(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class _UpstreamPool:
    """Kept-alive connections to the upstream, reused one request at a time."""

    def __init__(self, upstream: Upstream, limits: GuardLimits) -> None:
        self.upstream = upstream
        self.limits = limits
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._ssl = ssl.create_default_context() if upstream.tls else None

    async def get(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        while self._idle:
            reader, writer = self._idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer, True
            writer.close()
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(self.upstream.host, self.upstream.port, ssl=self._ssl,
                                    limit=STREAM_BUFFER_BYTES),
            self.limits.connect_timeout_s)
        return reader, writer, False

    def put(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._idle) < self.limits.max_idle_upstream and not reader.at_eof():
            self._idle.append((reader, writer))
        else:
            writer.close()

    def close(self) -> None:
        for _reader, writer in self._idle:
            writer.close()
        self._idle.clear()


class _Client:
    __slots__ = ("idle_since", "task", "writer")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.idle_since: float | None = time.monotonic()
        self.task = asyncio.current_task()


class _Refusal(Exception):
    def __init__(self, status: int, body: dict[str, Any], retry_after: int | None) -> None:
        super().__init__(body["error"]["message"])
        self.status = status
        self.body = body
        self.retry_after = retry_after


def error_body(kind: str, message: str, status: int, **fields: Any) -> dict[str, Any]:
    """OpenAI's error shape: `message`, `type`, `param`, `code`, then the guard's own fields."""
    return {"error": {"message": message, "type": kind, "param": None, "code": status, **fields}}


class GuardProxy:
    def __init__(self, upstream: Upstream, tracker: LimitTracker, metrics: GuardMetrics, *,
                 when_blind: str = "admit", limits: GuardLimits | None = None) -> None:
        if when_blind not in WHEN_BLIND:
            raise ConfigError(f"--when-blind: expected one of {', '.join(WHEN_BLIND)}, got {when_blind!r}")
        self.upstream = upstream
        self.tracker = tracker
        self.metrics = metrics
        self.when_blind = when_blind
        self.limits = limits or GuardLimits()
        self._pool = _UpstreamPool(upstream, self.limits)
        self._clients: set[_Client] = set()
        self._server: asyncio.base_events.Server | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------
    async def start(self, host: str, port: int) -> int:
        """Listen; the port actually bound (port 0 picks one)."""
        self._server = await asyncio.start_server(self._serve_client, host, port, backlog=1024,
                                                  limit=STREAM_BUFFER_BYTES, reuse_address=True)
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
        self._pool.close()

    @property
    def open_connections(self) -> int:
        return len(self._clients)

    # -- one client connection ------------------------------------------------------------------------
    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._clients) >= self.limits.max_connections and not self._evict_idlest():
            self.metrics.count(catalogue.GUARD_CONNECTIONS, "refused")
            writer.write(build_response(503, b"memtel guard: too many connections\n", "text/plain",
                                        keep_alive=False))
            with contextlib.suppress(Exception):
                await writer.drain()
            writer.close()
            return
        client = _Client(writer)
        self._clients.add(client)
        try:
            while True:
                client.idle_since = time.monotonic()
                raw = await asyncio.wait_for(read_head(reader, self.limits.max_head_bytes),
                                             self.limits.idle_timeout_s)
                client.idle_since = None
                if raw is None:
                    break
                started = time.perf_counter()
                request = parse_head(raw, request=True)
                keep_alive = _wants_keep_alive(request)
                body = await asyncio.wait_for(self._read_body(request, reader, writer),
                                              self.limits.request_timeout_s)
                if not await self._handle(request, body, writer, keep_alive, started):
                    break
        except HttpError as exc:
            self.metrics.count(catalogue.GUARD_REJECTED, "bad_request")
            await self._answer(writer, exc.status, error_body(GUARD_BAD_REQUEST, str(exc), exc.status),
                               keep_alive=False)
            # A lingering close: read (and drop) what the client is still sending for a moment, so it reads
            # the answer instead of a reset (RFC 9112 section 9.6).
            with contextlib.suppress(asyncio.TimeoutError, ConnectionError, OSError):
                await asyncio.wait_for(_discard(reader, LINGER_BYTES), LINGER_S)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except asyncio.CancelledError:  # the guard is stopping
            pass
        except Exception as exc:  # one bad connection must never stop the guard
            log.exception("memtel guard: a connection failed: %s: %s", type(exc).__name__, exc)
        finally:
            self._clients.discard(client)
            writer.close()

    def _evict_idlest(self) -> bool:
        idle = [c for c in self._clients if c.idle_since is not None]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c.idle_since or 0.0)
        self._clients.discard(victim)
        victim.writer.close()
        self.metrics.count(catalogue.GUARD_CONNECTIONS, "evicted")
        return True

    async def _read_body(self, request: Message, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        if "chunked" in request.tokens("transfer-encoding") or request.get("transfer-encoding"):
            raise HttpError(411, "chunked request bodies are not accepted; send the body with a Content-Length")
        length = content_length(request, request=True) or 0
        if length > self.limits.max_body_bytes:
            raise HttpError(413, f"request body of {length} bytes is larger than the guard's limit of "
                                 f"{self.limits.max_body_bytes} bytes")
        if not length:
            return b""
        if "100-continue" in request.tokens("expect"):
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return await reader.readexactly(length)

    # -- one request ----------------------------------------------------------------------------------
    async def _handle(self, request: Message, body: bytes, writer: asyncio.StreamWriter, keep_alive: bool,
                      started: float) -> bool:
        method, target = request.start[0], request.start[1]
        path = target.split("?", 1)[0]
        if path in GUARDED:
            if method != "POST":
                return await self._refuse_path(writer, keep_alive, 405, f"{path} takes POST, not {method}")
            return await self._guarded(request, path, body, writer, keep_alive, started)
        gets = PASS_THROUGH["GET"]
        if path == "/health" and self.when_blind == "reject" and self.tracker.limit() is None:
            # Refusing every completion while blind, the service is down for clients: say so where load
            # balancers and the harness look (and a guard that has not seen its first forecast is not ready).
            self.metrics.count(catalogue.GUARD_REJECTED, "blind")
            message = f"memtel guard: blind (--when-blind reject): {self.tracker.why_blind()}"
            await self._answer(writer, 503, error_body(GUARD_BLIND, message, 503), keep_alive,
                               (("Retry-After", str(RETRY_AFTER_S["blind"])),))
            return keep_alive
        if (method in ("GET", "HEAD") and (path in gets or path.startswith(MODEL_PATH_PREFIX))) or \
                (method == "POST" and path in PASS_THROUGH["POST"]):
            self.metrics.count(catalogue.GUARD_PASSED_THROUGH)
            return await self._forward(request, body, writer, keep_alive, started, None)
        known = ", ".join([*GUARDED, *gets, *PASS_THROUGH["POST"]])
        return await self._refuse_path(writer, keep_alive, 404,
                                       f"{method} {path[:100]} is not forwarded by the memtel guard (it forwards "
                                       f"{known})")

    async def _refuse_path(self, writer: asyncio.StreamWriter, keep_alive: bool, status: int, message: str) -> bool:
        self.metrics.count(catalogue.GUARD_REJECTED, "not_forwarded")
        await self._answer(writer, status, error_body(GUARD_NOT_FORWARDED, message, status), keep_alive)
        return keep_alive

    async def _guarded(self, request: Message, path: str, raw: bytes, writer: asyncio.StreamWriter,
                       keep_alive: bool, started: float) -> bool:
        try:
            if len(raw) > INLINE_PARSE_BYTES:  # a long prompt takes tens of ms to parse: not on the event loop
                size = await asyncio.to_thread(_measure_all, path, raw)
            else:
                size = measure(path, parse_body(raw))
        except PromptError as exc:
            self.metrics.count(catalogue.GUARD_REJECTED, "bad_request")
            await self._answer(writer, 400, error_body(GUARD_BAD_REQUEST, str(exc), 400), keep_alive)
            return keep_alive
        try:
            held, counted_by = await self._admit(request, size)
        except _Refusal as refusal:
            self.metrics.observe_added(time.perf_counter() - started)
            extra = (("Retry-After", str(refusal.retry_after)),) if refusal.retry_after is not None else ()
            await self._answer(writer, refusal.status, refusal.body, keep_alive, extra)
            return keep_alive
        self.metrics.count(catalogue.GUARD_ADMITTED, path, counted_by)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.tracker.release(held)

        try:
            return await self._forward(request, raw, writer, keep_alive, started, release)
        finally:
            release()

    async def _admit(self, request: Message, size: PromptSize) -> tuple[int, str]:
        """(tokens held while the prefill runs, how they were counted); _Refusal to refuse."""
        limit = self.tracker.limit()
        if limit is None:
            return self._blind()
        if size.most_tokens <= limit.tokens:
            self.tracker.hold(size.most_tokens)
            return size.most_tokens, "token_ids" if size.exact else "byte_bound"
        if size.exact or size.least_tokens > limit.tokens:
            counted_by = "token_ids" if size.exact else "words"
            tokens = size.most_tokens if size.exact else size.least_tokens
            self._refuse(tokens, counted_by, limit)
        tokens = await self._tokenize(request, size)
        limit = self.tracker.limit()  # the hooks and the holds may have changed while the upstream counted
        if limit is None:
            return self._blind()
        if tokens > limit.tokens:
            self._refuse(tokens, "tokenize", limit)
        self.tracker.hold(tokens)
        return tokens, "tokenize"

    def _blind(self) -> tuple[int, str]:
        if self.when_blind == "admit":
            self.metrics.count(catalogue.GUARD_BLIND_DECISIONS, "admit")
            return 0, "blind"
        self.metrics.count(catalogue.GUARD_BLIND_DECISIONS, "reject")
        self.metrics.count(catalogue.GUARD_REJECTED, "blind")
        message = ("the memtel guard is blind (no fresh forecast from any hook) and refuses requests until it sees "
                   f"again (--when-blind reject): {self.tracker.why_blind()}")
        raise _Refusal(503, error_body(GUARD_BLIND, message, 503, hooks=[h.target.url for h in
                                                                                  self.tracker.hooks]),
                       RETRY_AFTER_S["blind"])

    def _refuse(self, tokens: int, counted_by: str, limit: Limit) -> None:
        fit = limit.fit
        reason = "would_not_fit" if tokens > limit.rank_tokens else "in_prefill"
        self.metrics.count(catalogue.GUARD_REJECTED, reason)
        forecast = fit.forecast_for(tokens)
        at_least = "at least " if counted_by == "words" else ""
        why = (f"it would not fit: rank {fit.rank} on node {fit.node} can take a prefill of at most "
               f"{limit.rank_tokens:,} tokens now" if reason == "would_not_fit" else
               f"it fits rank {fit.rank} on node {fit.node} ({limit.rank_tokens:,} tokens) alone, but not beside the "
               f"{limit.in_prefill_tokens:,} tokens of admitted requests still in their prefill")
        message = f"memtel guard: the prompt has {at_least}{tokens:,} tokens and {why}"
        fields = {
            "reason": reason, "prompt_tokens": tokens, "prompt_tokens_counted_by": counted_by,
            "limit_tokens": limit.tokens, "max_prefill_tokens": limit.rank_tokens,
            "in_prefill_tokens": limit.in_prefill_tokens, "node": fit.node, "rank": fit.rank, "hook": limit.hook,
            "fit_budget_bytes": _int_or_none(fit.budget_bytes),
            "forecast_tokens": forecast[0] if forecast else None,
            "forecast_bytes": _int_or_none(forecast[1]) if forecast else None,
        }
        raise _Refusal(503, error_body(GUARD_WOULD_NOT_FIT, message, 503, **fields), RETRY_AFTER_S[reason])

    async def _tokenize(self, request: Message, size: PromptSize) -> int:
        """The upstream's exact count; an answer other than a count is relayed to the client as a _Refusal."""
        assert size.tokenize_body is not None
        body = json.dumps(size.tokenize_body, ensure_ascii=False).encode()
        headers = [(k, v) for k, v in request.headers if k.lower() in ("authorization", "x-api-key")]
        headers.append(("Content-Type", _JSON))
        self.metrics.count(catalogue.GUARD_TOKENIZE_CALLS)
        try:
            status, answer = await self._exchange("POST", "/tokenize", headers, body)
        except (OSError, asyncio.TimeoutError, UpstreamClosed, HttpError) as exc:
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

    async def _exchange(self, method: str, path: str, headers: list[tuple[str, str]],
                        body: bytes) -> tuple[int, bytes]:
        """One request to the upstream, its whole answer read (for /tokenize: a few MB at most)."""
        reader, writer, reused = await self._pool.get()
        try:
            writer.write(build_request(method, path, headers, self.upstream.host_header, body))
            raw = await read_head(reader, self.limits.max_head_bytes)
            if raw is None:
                if not reused:
                    raise UpstreamClosed("the upstream closed the connection without an answer")
                writer.close()
                reader, writer, reused = await self._pool.get()
                writer.write(build_request(method, path, headers, self.upstream.host_header, body))
                raw = await read_head(reader, self.limits.max_head_bytes)
                if raw is None:
                    raise UpstreamClosed("the upstream closed the connection without an answer")
            response = parse_head(raw, request=False)
            sink = _Sink(self.limits.max_body_bytes, "chunked" in response.tokens("transfer-encoding"))
            reusable = await BodyRelay(reader, sink).relay(response, False)  # type: ignore[arg-type]
        except BaseException:
            writer.close()
            raise
        if reusable and "close" not in response.tokens("connection"):
            self._pool.put(reader, writer)
        else:
            writer.close()
        return int(response.start[1]), sink.data()

    async def _forward(self, request: Message, body: bytes, writer: asyncio.StreamWriter, keep_alive: bool,
                       started: float, first_byte: Callable[[], None] | None) -> bool:
        method, target = request.start[0], request.start[1]
        data = build_request(method, target, request.headers, self.upstream.host_header, body)
        up_reader, up_writer, reused = await self._connect_or_answer(writer, keep_alive)
        if up_reader is None or up_writer is None:
            return keep_alive
        try:
            up_writer.write(data)
            self.metrics.observe_added(time.perf_counter() - started)
            try:
                raw = await read_head(up_reader, self.limits.max_head_bytes)
            except ConnectionError:
                if not reused:
                    raise
                raw = None
            if raw is None and reused:  # a kept-alive connection the upstream had closed: once more, fresh
                up_writer.close()
                up_reader, up_writer, _ = await self._pool.get()
                up_writer.write(data)
                raw = await read_head(up_reader, self.limits.max_head_bytes)
            if raw is None:
                raise UpstreamClosed("the upstream closed the connection without an answer")
            response = parse_head(raw, request=False)
            while 100 <= int(response.start[1]) < 200:  # interim answers are the upstream's and the guard's
                raw = await read_head(up_reader, self.limits.max_head_bytes)
                if raw is None:
                    raise UpstreamClosed("the upstream closed the connection without an answer")
                response = parse_head(raw, request=False)
        except (OSError, asyncio.TimeoutError, UpstreamClosed, HttpError, asyncio.IncompleteReadError) as exc:
            up_writer.close()
            self.metrics.count(catalogue.GUARD_UPSTREAM_FAILURES, "request")
            await self._answer(writer, 502, error_body(GUARD_UPSTREAM_UNAVAILABLE,
                                                       f"memtel guard: the upstream {self.upstream.url} did not "
                                                       f"answer: {type(exc).__name__}: {exc}", 502), False)
            return False
        framed = "chunked" in response.tokens("transfer-encoding") or content_length(response, request=False) \
            is not None or method == "HEAD" or int(response.start[1]) in (204, 304)
        client_keep = keep_alive and framed
        relay = BodyRelay(up_reader, writer, first_byte)
        try:
            writer.write(relayed_head(response, keep_alive=client_keep))
            reusable = await relay.relay(response, method == "HEAD")
        except (OSError, asyncio.IncompleteReadError, UpstreamClosed, HttpError, ConnectionError,
                asyncio.LimitOverrunError):
            # Mid-body: the head is out, so the client learns of it by the connection closing. Closing the
            # upstream's connection tells a streaming engine to abort the request.
            up_writer.close()
            if not relay.client_gone:
                self.metrics.count(catalogue.GUARD_UPSTREAM_FAILURES, "body")
            return False
        if reusable and not relay.client_gone and "close" not in response.tokens("connection"):
            self._pool.put(up_reader, up_writer)
        else:
            up_writer.close()
        return client_keep and not relay.client_gone

    async def _connect_or_answer(self, writer: asyncio.StreamWriter, keep_alive: bool) \
            -> tuple[asyncio.StreamReader | None, asyncio.StreamWriter | None, bool]:
        try:
            return await self._pool.get()
        except (OSError, asyncio.TimeoutError) as exc:
            self.metrics.count(catalogue.GUARD_UPSTREAM_FAILURES, "connect")
            reason = getattr(exc, "strerror", None) or type(exc).__name__
            await self._answer(writer, 502, error_body(GUARD_UPSTREAM_UNAVAILABLE,
                                                       f"memtel guard: cannot reach the upstream {self.upstream.url}: "
                                                       f"{reason}", 502), keep_alive)
            return None, None, False

    async def _answer(self, writer: asyncio.StreamWriter, status: int, payload: dict[str, Any], keep_alive: bool,
                      extra: tuple[tuple[str, str], ...] = ()) -> None:
        data = json.dumps(payload).encode() + b"\n"
        try:
            writer.write(build_response(status, data, _JSON, keep_alive=keep_alive, extra=extra))
            await writer.drain()
        except (ConnectionError, OSError):
            pass


class _Sink:
    """A stand-in client writer that keeps what is written (bounded)."""

    def __init__(self, limit: int, chunked: bool) -> None:
        self._parts: list[bytes] = []
        self._size = 0
        self._limit = limit
        self._chunked = chunked

    def write(self, data: bytes) -> None:
        self._size += len(data)
        if self._size > self._limit:
            raise HttpError(502, f"the upstream's answer is larger than {self._limit} bytes")
        self._parts.append(data)

    async def drain(self) -> None:
        return None

    def data(self) -> bytes:
        return dechunk(b"".join(self._parts)) if self._chunked else b"".join(self._parts)


def _measure_all(path: str, raw: bytes) -> PromptSize:
    size = measure(path, parse_body(raw))
    _ = size.least_tokens  # counted here too, off the event loop (it is cached on the object)
    return size


async def _discard(reader: asyncio.StreamReader, most: int) -> None:
    while most > 0 and (piece := await reader.read(65536)):
        most -= len(piece)


def _wants_keep_alive(request: Message) -> bool:
    tokens = request.tokens("connection")
    if request.start[2] == "HTTP/1.1":
        return "close" not in tokens
    return "keep-alive" in tokens


def _int_or_none(value: float | None) -> int | None:
    return int(value) if value is not None and math.isfinite(value) else None


__all__ = ["GUARDED", "PASS_THROUGH", "WHEN_BLIND", "GuardLimits", "GuardProxy", "Upstream", "error_body"]
