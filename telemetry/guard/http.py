"""HTTP/1.1 for the guard through h11's state machines: a server to its clients, a client to the upstream and hooks.

h11 parses and frames every message (RFC 9112); the guard writes no framing of its own and never re-parses
bytes. It is stricter than h11 where a proxy must be (a recipient MAY accept these, RFC 9112 sections 2.2,
5.2 and 6.3; a proxy whose upstream reads them otherwise is a smuggling proxy):

- a request head whose lines do not all end in CRLF (a bare LF, a lone CR) or that folds a header line
  (obs-fold: a line starting with a space or tab) is refused 400;
- a request with both `Content-Length` and `Transfer-Encoding` is refused 400 (h11 lets chunked win).

A request goes upstream re-framed: its body is read whole (h11 removes a chunked framing), then sent with
the guard's own `Content-Length`, so the upstream parses exactly the bytes the guard sized. An upstream
connection is reused only when h11 says both sides finished the exchange and no byte follows the response;
a byte that arrives while it sits idle closes it (`Channel.idle`).

Every connection is a `Channel`: reading stops while more than `BUFFER_BYTES` wait unread, and writing waits
while the kernel's buffer is full, so a response body is relayed in pieces of at most `RELAY_PIECE` bytes
plus one socket read, whatever size the upstream declares; a slow client slows the upstream's stream.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import cast

import h11

from telemetry.exporter.protocol import reason_phrase

BUFFER_BYTES = 65536  # a connection stops reading the socket while this much waits unread
BODY_EVENTS_PER_YIELD = 256  # a body's chunks parsed between two yields to the event loop
RELAY_PIECE = 65536  # an upstream chunk larger than this is relayed in pieces of this size
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "upgrade", "transfer-encoding", "expect", "host", "content-length"})
# Where h11 finds the end of a head (its receive buffer's rule), and what the guard refuses inside one.
_HEAD_END = re.compile(rb"\n\r?\n")
_NOT_CRLF = re.compile(rb"(?<!\r)\n|\r(?!\n)|\n[ \t]")
ERROR_TEXT_CHARS = 200


class HttpError(Exception):
    """A request the guard answers itself with `status` and one line; the connection closes after it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message[:ERROR_TEXT_CHARS])
        self.status = status


class UpstreamError(Exception):
    """The upstream (or a hook) broke HTTP/1.1, or closed the connection inside its answer."""


class UpstreamClosed(UpstreamError):
    """The upstream closed the connection before a byte of its answer (a kept-alive one it timed out)."""


class Channel(asyncio.Protocol):
    """One connection as a byte pipe with backpressure both ways; `idle` marks a pooled upstream connection."""

    def __init__(self, on_connect: Callable[[Channel], None] | None = None) -> None:
        self.on_connect = on_connect  # a server's: starts serving the connection
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._eof = False
        self._waiter: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None
        self._paused_reading = False
        self._paused_writing = False
        self.closed = False
        self.idle = False  # pooled: any byte or EOF now is not an answer to anything, so the connection goes
        self._gone: asyncio.Future[None] | None = None  # resolved at the peer's EOF (`gone`)

    # -- asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport: uvloop's is not a subclass of asyncio.Transport, so this is a cast, not a check.
        self.transport = cast(asyncio.Transport, transport)
        if self.on_connect is not None:
            self.on_connect(self)

    def data_received(self, data: bytes) -> None:
        if self.idle:
            self.close()
            return
        self._buffer += data
        if len(self._buffer) >= BUFFER_BYTES and not self._paused_reading and self.transport is not None:
            self._paused_reading = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        if self.idle:
            self.close()
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = self._eof = True
        self._wake()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def pause_writing(self) -> None:
        self._paused_writing = True

    def resume_writing(self) -> None:
        self._paused_writing = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if self._eof and self._gone is not None and not self._gone.done():
            self._gone.set_result(None)

    def gone(self) -> asyncio.Future[None]:
        """A future resolved when the peer closes its side (EOF) or the connection is lost: a queued client
        that leaves is seen at once, without reading (its next request, if pipelined, stays buffered)."""
        if self._gone is None:
            self._gone = asyncio.get_running_loop().create_future()
            if self._eof:
                self._gone.set_result(None)
        return self._gone

    # -- the pipe ----------------------------------------------------------------------------------
    async def read(self, timeout_s: float | None) -> bytes:
        """What has arrived (at most BUFFER_BYTES plus one socket read), b"" at the end; TimeoutError."""
        if not self._buffer and not self._eof:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await _within(self._waiter, timeout_s)
            finally:
                self._waiter = None
        data = bytes(self._buffer)
        self._buffer.clear()
        if self._paused_reading and self.transport is not None and not self.closed:
            self._paused_reading = False
            self.transport.resume_reading()
        return data

    async def write(self, data: bytes, timeout_s: float | None) -> None:
        """Write and wait until the kernel takes it (backpressure); ConnectionError once closed."""
        if self.closed or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the connection is closed")
        self.transport.write(data)
        if self._paused_writing:
            self._drained = asyncio.get_running_loop().create_future()
            try:
                await _within(self._drained, timeout_s)
            except asyncio.TimeoutError:
                self.close()  # a peer that takes nothing for that long is gone
                raise
            finally:
                self._drained = None
            if self.closed:
                raise ConnectionResetError("the connection closed while writing")

    async def discard(self, most_bytes: int, timeout_s: float) -> None:
        """Read and drop what the peer still sends, for a moment (a lingering close, RFC 9112 section 9.6)."""
        deadline = time.monotonic() + timeout_s
        while most_bytes > 0 and (left := deadline - time.monotonic()) > 0:
            try:
                data = await self.read(left)
            except asyncio.TimeoutError:
                return
            if not data:
                return
            most_bytes -= len(data)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        self.closed = True


async def _within(future: asyncio.Future[None], timeout_s: float | None) -> None:
    """Wait for `future`, TimeoutError after `timeout_s` (asyncio.wait_for costs a loop iteration more per read,
    a tenth of the guard's added latency)."""
    if timeout_s is None:
        return await future
    if timeout_s <= 0:
        raise asyncio.TimeoutError
    def expire() -> None:
        if not future.done():
            future.set_exception(asyncio.TimeoutError())

    handle = asyncio.get_running_loop().call_later(timeout_s, expire)
    try:
        await future
    finally:
        handle.cancel()


async def open_channel(host: str, port: int, context: ssl.SSLContext | None, timeout_s: float) -> Channel:
    loop = asyncio.get_running_loop()
    _transport, channel = await asyncio.wait_for(
        loop.create_connection(Channel, host, port, ssl=context), timeout_s)
    return channel


@dataclass(frozen=True)
class Request:
    """A client's request head as h11 read it: header names as sent."""

    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]

    def get(self, name: str) -> str:
        name = name.lower()
        return ", ".join(v for k, v in self.headers if k.lower() == name)

    def has(self, name: str) -> bool:
        name = name.lower()
        return any(k.lower() == name for k, _v in self.headers)


def _reason(status: int) -> bytes:
    return reason_phrase(status).encode("ascii")   # the exporter's table too (telemetry/exporter/protocol.py)


def _wire(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    """Headers as h11 sends them: latin-1, as they were read (h11 would encode a str as ASCII)."""
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]


def _text(items: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in items]


def end_to_end(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The headers a proxy passes on: not the hop-by-hop ones (RFC 9110 section 7.6.1) nor those `Connection`
    names, nor the framing (the guard frames each message itself)."""
    named = {t.strip().lower() for k, v in headers if k.lower() == "connection" for t in v.split(",")}
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP and k.lower() not in named]


class _Side:
    def __init__(self, channel: Channel, conn: h11.Connection) -> None:
        self.channel = channel
        self.h11 = conn

    def _next(self) -> object:
        try:
            return self.h11.next_event()
        except h11.RemoteProtocolError as exc:
            raise self._protocol_error(exc) from None

    def _protocol_error(self, exc: h11.RemoteProtocolError) -> Exception:
        raise NotImplementedError

    def _feed(self, data: bytes) -> None:
        self.h11.receive_data(data)

    def _frame(self, *events: h11.Event) -> bytes:
        try:
            return b"".join(self.h11.send(e) or b"" for e in events)
        except h11.LocalProtocolError as exc:
            raise HttpError(502, f"the guard cannot send that message: {exc}") from None

    async def _send(self, *events: h11.Event, timeout_s: float | None) -> None:
        await self.channel.write(self._frame(*events), timeout_s)


class ServerSide(_Side):
    """One client connection, the guard as its server: request heads and bodies in, responses out."""

    def __init__(self, channel: Channel, max_head_bytes: int) -> None:
        super().__init__(channel, h11.Connection(h11.SERVER, max_incomplete_event_size=max_head_bytes))
        self.max_head_bytes = max_head_bytes
        self._held = b""  # a framed response head not yet written
        self.deadline = 0.0  # monotonic time by which the request in progress must be read whole

    def _protocol_error(self, exc: h11.RemoteProtocolError) -> Exception:
        status = exc.error_status_hint
        if status == 431:
            return HttpError(431, f"the request head is larger than {self.max_head_bytes} bytes")
        return HttpError(status, f"malformed request: {exc}")

    async def _read(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise asyncio.TimeoutError
        self._feed(await self.channel.read(timeout_s))

    async def next_request(self, idle_s: float, read_s: float, request_s: float) -> Request | None:
        """The next request's head, or None when the client closed between requests; HttpError when malformed.

        The first byte may take `idle_s`; from it the request (head and body) must be read within
        `request_s`, and no read may wait longer than `read_s`."""
        raw = bytearray(self.h11.trailing_data[0])  # a pipelined request already read
        started = bool(raw)
        self.deadline = time.monotonic() + request_s
        while True:
            if len(raw) > self.max_head_bytes:  # h11 bounds a head only while it is incomplete
                end = _HEAD_END.search(raw)
                if end is None or end.start() > self.max_head_bytes:
                    raise HttpError(431, f"the request head is larger than {self.max_head_bytes} bytes")
            event = self._next()
            if event is h11.NEED_DATA:
                if started:
                    timeout_s = min(read_s, self.deadline - time.monotonic())
                    if timeout_s <= 0:
                        raise asyncio.TimeoutError
                    data = await self.channel.read(timeout_s)
                else:
                    data = await self.channel.read(idle_s)
                    started = True
                    self.deadline = time.monotonic() + request_s
                if len(raw) <= self.max_head_bytes:  # past it h11 refuses the head (431) anyway
                    raw += data
                self._feed(data)
                continue
            if isinstance(event, h11.ConnectionClosed):
                return None
            if not isinstance(event, h11.Request):
                raise HttpError(400, "malformed request")
            self._strict(bytes(raw))
            version = event.http_version.decode("ascii")
            if version not in ("1.0", "1.1"):
                raise HttpError(505, f"HTTP/{version[:8]} is not supported; expected HTTP/1.1 or HTTP/1.0")
            return Request(event.method.decode("ascii"), event.target.decode("ascii"), version,
                           _text(event.headers.raw_items()))

    def _strict(self, raw: bytes) -> None:
        end = _HEAD_END.search(raw)
        head = raw[:end.end()] if end else raw
        found = _NOT_CRLF.search(head)
        if found is not None:
            what = "a folded header line (obs-fold)" if head[found.end() - 1:found.end()] in (b" ", b"\t") \
                else "a bare LF or CR"
            raise HttpError(400, f"malformed request head: {what}; every line must end in CRLF")

    async def read_body(self, max_bytes: int, read_s: float, send_s: float) -> bytes:
        """The request's body, whole (de-chunked); HttpError(413) past `max_bytes`, TimeoutError past a deadline."""
        if self.h11.client_is_waiting_for_100_continue:
            await self._send(h11.InformationalResponse(status_code=100, reason=_reason(100), headers=[]),
                             timeout_s=send_s)
        # One buffer, not a part per chunk (a body in 1-byte chunks is a million parts a megabyte), and a yield to
        # the event loop every BODY_EVENTS_PER_YIELD chunks: parsing them costs by their number, not their bytes.
        body = bytearray()
        events = 0
        while True:
            event = self._next()
            if event is h11.NEED_DATA:
                await self._read(min(read_s, self.deadline - time.monotonic()))
            elif isinstance(event, h11.Data):
                if len(body) + len(event.data) > max_bytes:
                    raise HttpError(413, f"request body larger than the guard's limit of {max_bytes} bytes")
                body += event.data
                events += 1
                if events % BODY_EVENTS_PER_YIELD == 0:
                    await asyncio.sleep(0)
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)
            else:  # the client closed inside its body
                raise ConnectionResetError("the client closed inside its request body")

    @property
    def mid_request(self) -> bool:
        """Part of a request has arrived, not all of it."""
        state = self.h11.their_state
        return state is h11.SEND_BODY or (state is h11.IDLE and bool(self.h11.trailing_data[0]))

    @property
    def answering(self) -> bool:
        """A response may still be started (none is under way)."""
        return self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE)

    async def respond(self, status: int, headers: list[tuple[str, str]], body: bytes, send_s: float) -> None:
        headers = [*headers, ("Content-Length", str(len(body)))]
        await self._send(h11.Response(status_code=status, reason=_reason(status), headers=_wire(headers)),
                         h11.Data(data=body), h11.EndOfMessage(), timeout_s=send_s)

    def start(self, status: int, reason: bytes, headers: list[tuple[str, str]]) -> None:
        """Frame a response head; it goes out with the body's first piece (or its end): one write, not two."""
        self._held = self._frame(h11.Response(status_code=status, reason=reason, headers=_wire(headers)))

    async def send(self, data: bytes, send_s: float) -> None:
        held, self._held = self._held, b""
        await self.channel.write(held + self._frame(h11.Data(data=data)), send_s)

    async def end(self, send_s: float) -> None:
        held, self._held = self._held, b""
        data = held + self._frame(h11.EndOfMessage())
        if data:
            await self.channel.write(data, send_s)

    def pipelined(self) -> bool:
        """The client's next request has already arrived (pipelined behind the one just answered)."""
        return bool(self.h11.trailing_data[0]) or bool(self.channel._buffer)

    def next_cycle(self) -> bool:
        """Ready for the client's next request: both sides finished and neither asked to close."""
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
            return True
        return False


@dataclass(frozen=True)
class Response:
    """An upstream's response head."""

    status: int
    reason: bytes
    headers: list[tuple[str, str]]

    def relayed_headers(self) -> list[tuple[str, str]]:
        """Its end-to-end headers, with its `Content-Length` where that framed it (h11 frames the rest)."""
        out = end_to_end(self.headers)
        names = {k.lower() for k, _v in self.headers}
        if "transfer-encoding" not in names:
            out += [(k, v) for k, v in self.headers if k.lower() == "content-length"][:1]
        return out


class ClientSide(_Side):
    """One connection to the upstream (or a hook), the guard as its client: one exchange at a time."""

    def __init__(self, channel: Channel, max_head_bytes: int) -> None:
        super().__init__(channel, h11.Connection(h11.CLIENT, max_incomplete_event_size=max_head_bytes))
        self._received = False

    def _protocol_error(self, exc: h11.RemoteProtocolError) -> Exception:
        if not self._received:
            return UpstreamClosed("the connection closed without an answer")
        return UpstreamError(f"malformed answer: {exc}"[:ERROR_TEXT_CHARS])

    async def _read(self, timeout_s: float | None) -> None:
        data = await self.channel.read(timeout_s)
        self._received = self._received or bool(data)
        self._feed(data)

    async def send_request(self, method: str, target: str, headers: list[tuple[str, str]], body: bytes,
                           send_s: float | None) -> None:
        """The request, framed by h11: `Content-Length` for a body (or a POST), none otherwise."""
        if body or method not in ("GET", "HEAD"):
            headers = [*headers, ("Content-Length", str(len(body)))]
        events: list[h11.Event] = [h11.Request(method=method, target=target, headers=_wire(headers))]
        if body:
            events.append(h11.Data(data=body))
        events.append(h11.EndOfMessage())
        await self._send(*events, timeout_s=send_s)

    async def response(self, timeout_s: float | None = None) -> Response:
        """The response head (interim 1xx answers skipped)."""
        while True:
            event = self._next()
            if event is h11.NEED_DATA:
                await self._read(timeout_s)
            elif isinstance(event, h11.Response):
                headers = _text(event.headers.raw_items())
                if {"content-length", "transfer-encoding"} <= {k.lower() for k, _v in headers}:
                    raise UpstreamError("the answer has both Content-Length and Transfer-Encoding")
                return Response(event.status_code, bytes(event.reason), headers)
            elif isinstance(event, h11.InformationalResponse):
                continue
            else:
                raise UpstreamClosed("the connection closed without an answer")

    async def body(self, read_s: float | None = None) -> AsyncIterator[bytes]:
        """The response body in pieces: an upstream chunk whole up to RELAY_PIECE bytes, larger ones in pieces."""
        pending = bytearray()
        in_chunk = False
        while True:
            event = self._next()
            if event is h11.NEED_DATA:
                await self._read(read_s)
            elif isinstance(event, h11.Data):
                pending += event.data
                in_chunk = (in_chunk or event.chunk_start) and not event.chunk_end
                if not in_chunk or len(pending) >= RELAY_PIECE:
                    yield bytes(pending)
                    pending.clear()
            elif isinstance(event, h11.EndOfMessage):
                if pending:
                    yield bytes(pending)
                return
            else:
                raise UpstreamError("the connection closed inside the answer's body")

    async def read_all(self, max_bytes: int, read_s: float | None = None) -> bytes:
        parts: list[bytes] = []
        size = 0
        async for piece in self.body(read_s):
            size += len(piece)
            if size > max_bytes:
                raise UpstreamError(f"the answer is larger than {max_bytes} bytes")
            parts.append(piece)
        return b"".join(parts)

    def reusable(self) -> bool:
        """Ready for another exchange: h11 says both sides are done, nothing follows the answer, still open."""
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE and not self.channel.closed \
                and not self.h11.trailing_data[0] and not self.h11.trailing_data[1]:
            self.h11.start_next_cycle()
            return True
        return False


__all__ = ["BUFFER_BYTES", "HOP_BY_HOP", "RELAY_PIECE", "Channel", "ClientSide", "HttpError", "Request", "Response",
           "ServerSide", "UpstreamClosed", "UpstreamError", "end_to_end", "open_channel"]
