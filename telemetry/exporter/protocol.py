"""The little HTTP/1.x an exporter needs, as pure functions: split and parse a request, build a response.

Only GET and HEAD without a body are served (Prometheus sends nothing else). Keep-alive follows
RFC 9112: an HTTP/1.1 connection stays open unless a `Connection: close` token says otherwise, an
HTTP/1.0 one only with `Connection: keep-alive`; a response that closes says `Connection: close`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from http import HTTPStatus

MAX_HEADERS = 64
_TOKEN_CHARS = frozenset(b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def reason_phrase(status: int) -> str:
    """The status line's reason: the standard library's table (http.HTTPStatus), the one the guard sends too."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


class BadRequest(Exception):
    """A request that cannot be served; `status` is the response code. The connection is closed after it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # the target without its query string
    version: str  # "HTTP/1.1" or "HTTP/1.0"
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names; repeated ones joined by ", "

    @property
    def keep_alive(self) -> bool:
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        if self.version == "HTTP/1.1":
            return "close" not in tokens
        return "keep-alive" in tokens


def split_head(buffer: bytes | bytearray) -> tuple[bytes, bytes] | None:
    """(request head without its blank line, what follows) once the head is complete, else None."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return None
    return bytes(buffer[:end]), bytes(buffer[end + 4:])


def parse_request(head: bytes) -> Request:
    """Parse a request head (request line and header lines, CRLF-separated); BadRequest if malformed."""
    try:
        text = head.decode("ascii")
    except UnicodeDecodeError:
        raise BadRequest(400, "request head is not ASCII") from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        raise BadRequest(400, "malformed request line")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise BadRequest(505 if version.startswith("HTTP/") else 400, f"unsupported protocol {version[:16]!r}")
    if not method or not all(ord(c) in _TOKEN_CHARS for c in method):
        raise BadRequest(400, "malformed method")
    if target.startswith(("http://", "https://")):  # absolute form: keep only the path
        slash = target.find("/", target.find("//") + 2)
        target = target[slash:] if slash >= 0 else "/"
    if not target.startswith("/") or any(ord(c) <= 32 or ord(c) == 127 for c in target):
        raise BadRequest(400, "malformed request target")
    if len(lines) - 1 > MAX_HEADERS:
        raise BadRequest(431, f"more than {MAX_HEADERS} header lines")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or not all(ord(c) in _TOKEN_CHARS for c in name):
            raise BadRequest(400, "malformed header line")  # also rejects obsolete line folding
        key = name.lower()
        value = value.strip(" \t")
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    if "transfer-encoding" in headers or headers.get("content-length", "0").strip() not in ("0", ""):
        raise BadRequest(413, "request bodies are not accepted")
    return Request(method, target.split("?", 1)[0], version, headers)


def build_response(status: int, body: bytes, content_type: str, *, keep_alive: bool, version: str = "HTTP/1.1",
                   head_only: bool = False, extra_headers: tuple[tuple[str, str], ...] = ()) -> bytes:
    """Status line, headers and body in one buffer (one write, one segment on loopback)."""
    lines = [f"HTTP/1.1 {status} {reason_phrase(status)}",
             f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]
    if not keep_alive:
        lines.append("Connection: close")
    elif version == "HTTP/1.0":
        lines.append("Connection: keep-alive")
    lines.extend(f"{name}: {value}" for name, value in extra_headers)
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + body


__all__ = ["BadRequest", "Request", "build_response", "parse_request", "reason_phrase", "split_head"]
