"""The HTTP/1.1 a reverse proxy needs, over asyncio streams: read a request, relay a response as it comes.

A request is read whole (head, then a `Content-Length` body up to a bound): the guard must see a prompt
before it decides. A response is relayed as it arrives: its head at once, then its body piece by piece
(`Content-Length`, chunked or until the upstream closes), each piece written to the client and drained
before the next is read, so a slow client slows the upstream's stream instead of filling the guard's
memory. Chunked framing is passed through as the upstream wrote it: a streamed completion reaches the
client chunk by chunk, byte for byte. Only hop-by-hop headers (RFC 9110 section 7.6.1) are not relayed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

REASONS = {100: "Continue", 200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           408: "Request Timeout", 411: "Length Required", 413: "Content Too Large", 417: "Expectation Failed",
           431: "Request Header Fields Too Large", 500: "Internal Server Error", 502: "Bad Gateway",
           503: "Service Unavailable", 504: "Gateway Timeout", 505: "HTTP Version Not Supported"}
MAX_HEADERS = 100
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "upgrade", "transfer-encoding", "expect"})
_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_PIECE = 65536


class HttpError(Exception):
    """A request the guard answers itself with `status` and one line; the connection closes after it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class UpstreamClosed(Exception):
    """The upstream closed the connection before a response head (a kept-alive connection it timed out)."""


@dataclass
class Message:
    """A request or response head: the first line's parts and the headers in order, names as sent."""

    start: tuple[str, str, str]
    headers: list[tuple[str, str]] = field(default_factory=list)

    def get(self, name: str, default: str = "") -> str:
        name = name.lower()
        values = [v for k, v in self.headers if k.lower() == name]
        return ", ".join(values) if values else default

    def tokens(self, name: str) -> set[str]:
        return {t.strip().lower() for t in self.get(name).split(",") if t.strip()}


def parse_head(raw: bytes, *, request: bool) -> Message:
    """A head without its blank line; HttpError(400/431/505) if malformed."""
    try:
        text = raw.decode("latin-1" if not request else "ascii")
    except UnicodeDecodeError:
        raise HttpError(400, "the request head is not ASCII") from None
    lines = text.split("\r\n")
    if len(lines) - 1 > MAX_HEADERS:
        raise HttpError(431, f"more than {MAX_HEADERS} header lines")
    parts = lines[0].split(" ", 2)
    if len(parts) != 3:
        raise HttpError(400, "malformed request line" if request else "malformed status line")
    if request:
        method, target, version = parts
        if version not in ("HTTP/1.1", "HTTP/1.0"):
            raise HttpError(505 if version.startswith("HTTP/") else 400, f"unsupported protocol {version[:16]!r}")
        if not method or not set(method) <= _TOKEN_CHARS:
            raise HttpError(400, "malformed method")
        if not target.startswith("/") or any(ord(c) <= 32 or ord(c) == 127 for c in target):
            raise HttpError(400, "malformed request target (expected a path such as /v1/completions)")
    elif not parts[0].startswith("HTTP/1.") or not parts[1].isdigit() or len(parts[1]) != 3:
        raise HttpError(502, "the upstream sent a malformed status line")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or not set(name) <= _TOKEN_CHARS:
            raise HttpError(400 if request else 502, "malformed header line" if request
                            else "the upstream sent a malformed header line")
        headers.append((name, value.strip(" \t")))
    return Message((parts[0], parts[1], parts[2]), headers)


async def read_head(reader: asyncio.StreamReader, max_bytes: int) -> bytes | None:
    """The next head (without its blank line), or None at a clean end of stream before any byte."""
    try:
        data = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial.strip():
            return None
        raise HttpError(400, "the connection ended inside a message head") from None
    except asyncio.LimitOverrunError:
        raise HttpError(431, f"message head larger than {max_bytes} bytes") from None
    if len(data) - 4 > max_bytes:
        raise HttpError(431, f"message head larger than {max_bytes} bytes")
    return data[:-4]


def content_length(message: Message, *, request: bool) -> int | None:
    """The body's declared length; None if there is no Content-Length header."""
    values = {v.strip() for k, v in message.headers if k.lower() == "content-length"}
    if not values:
        return None
    joined = {part.strip() for v in values for part in v.split(",")}
    if len(joined) != 1 or not next(iter(joined)).isdigit() or len(next(iter(joined))) > 15:
        raise HttpError(400 if request else 502, "malformed Content-Length")
    return int(next(iter(joined)))


def build_response(status: int, body: bytes, content_type: str, *, keep_alive: bool,
                   extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}", f"Content-Type: {content_type}",
             f"Content-Length: {len(body)}"]
    if not keep_alive:
        lines.append("Connection: close")
    lines.extend(f"{name}: {value}" for name, value in extra)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def build_request(method: str, target: str, headers: list[tuple[str, str]], host: str, body: bytes) -> bytes:
    """The request as sent upstream: the client's end-to-end headers, the upstream's Host, the body's length."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    lines.extend(f"{k}: {v}" for k, v in headers
                 if k.lower() not in HOP_BY_HOP and k.lower() not in ("host", "content-length"))
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def relayed_head(response: Message, *, keep_alive: bool) -> bytes:
    """The upstream's response head for the client: its headers but the connection's own."""
    _version, status, reason = response.start
    lines = [f"HTTP/1.1 {status} {reason}"]
    chunked = "chunked" in response.tokens("transfer-encoding")
    lines.extend(f"{k}: {v}" for k, v in response.headers
                 if k.lower() not in HOP_BY_HOP or (k.lower() == "transfer-encoding" and chunked))
    if not keep_alive:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class BodyRelay:
    """Copies a response body from the upstream to the client piece by piece; `first_byte` runs once."""

    def __init__(self, upstream: asyncio.StreamReader, client: asyncio.StreamWriter,
                 first_byte: Callable[[], None] | None = None) -> None:
        self.upstream = upstream
        self.client = client
        self.first_byte = first_byte
        self.client_gone = False

    async def _write(self, data: bytes) -> None:
        if self.first_byte is not None:
            self.first_byte()
            self.first_byte = None
        if self.client_gone:
            return
        try:
            self.client.write(data)
            await self.client.drain()
        except (ConnectionError, OSError):
            self.client_gone = True

    async def relay(self, response: Message, head_request: bool) -> bool:
        """Relay the body; True if the upstream connection ended cleanly at the body's end (reusable)."""
        status = int(response.start[1])
        if head_request or status in (204, 304) or 100 <= status < 200:
            return True
        if "chunked" in response.tokens("transfer-encoding"):
            await self._chunked()
            return True
        length = content_length(response, request=False)
        if length is None:
            while piece := await self.upstream.read(_PIECE):  # until the upstream closes
                await self._write(piece)
                if self.client_gone:
                    return False
            return False
        left = length
        while left:
            piece = await self.upstream.read(min(left, _PIECE))
            if not piece:
                raise UpstreamClosed("the upstream closed inside a response body")
            left -= len(piece)
            await self._write(piece)
            if self.client_gone:
                return False
        return True

    async def _chunked(self) -> None:
        while True:
            line = await self.upstream.readuntil(b"\r\n")
            size_text = line.split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise HttpError(502, "the upstream sent a malformed chunk size") from None
            if size == 0:
                trailer = bytearray(line)
                while True:  # trailer fields, then the blank line that ends the body
                    field_line = await self.upstream.readuntil(b"\r\n")
                    trailer += field_line
                    if field_line == b"\r\n":
                        break
                await self._write(bytes(trailer))
                return
            data = await self.upstream.readexactly(size + 2)
            await self._write(line + data)  # one upstream chunk, one write: an SSE event reaches the client at once
            if self.client_gone:
                raise ConnectionError("the client went away mid-stream")

__all__ = ["HOP_BY_HOP", "BodyRelay", "HttpError", "Message", "UpstreamClosed", "build_request", "build_response",
           "content_length", "dechunk", "parse_head", "read_head", "relayed_head"]


def dechunk(data: bytes) -> bytes:
    """A body sent with `Transfer-Encoding: chunked`, whole, without its chunk framing (extensions ignored)."""
    out = bytearray()
    while data:
        line, _, rest = data.partition(b"\r\n")
        size = int(line.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2:]
    return bytes(out)
