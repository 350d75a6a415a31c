"""The exporter's HTTP/1.1 through h11's server state machine: requests read and responses framed by h11.

h11 parses every request head and frames every response (RFC 9112); this module writes no framing of its own and
never re-parses bytes. It only decides what an exporter serves: GET and HEAD without a body (Prometheus sends
nothing else; a body is refused 413), HTTP/1.1 and HTTP/1.0 (others 505). Keep-alive is h11's: an HTTP/1.1
connection stays open unless a `Connection: close` token says otherwise; h11 closes every HTTP/1.0 connection
after its answer (it does not implement HTTP/1.0 keep-alive) and says `Connection: close`. An HTTP/1.1 request
without `Host` is refused 400 (RFC 9112 section 3.2), as is anything else h11 refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus

import h11


def reason_phrase(status: int) -> str:
    """The status line's reason: the standard library's table (http.HTTPStatus), the one the guard sends too."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


class BadRequest(Exception):
    """A request that cannot be served; `status` is the response code. The connection is closed after it.
    `head_only`: the request was a HEAD, so the answer has no body (h11 refuses to send one)."""

    def __init__(self, status: int, message: str, *, head_only: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.head_only = head_only


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # the target without its query string (an absolute-form target: its path)
    version: str  # "HTTP/1.1" or "HTTP/1.0"
    authorization: str | None  # the Authorization header, if sent (repeated ones joined by ", ")


def new_connection(max_head_bytes: int) -> h11.Connection:
    """A server-side h11 connection whose incomplete request head may hold at most `max_head_bytes` (431 past)."""
    return h11.Connection(h11.SERVER, max_incomplete_event_size=max_head_bytes)


def next_request(http: h11.Connection) -> Request | None:
    """The next complete request from what `http` has received, or None until more arrives; BadRequest if h11
    refuses it or an exporter does not serve it (the connection is closed after the answer)."""
    if http.our_state is h11.DONE and http.their_state is h11.DONE:
        http.start_next_cycle()   # the previous exchange is over: a pipelined request may be waiting
    try:
        event = http.next_event()
        if not isinstance(event, h11.Request):
            return None   # NEED_DATA (or PAUSED: an answer is still being written)
        head_only = event.method == b"HEAD"
        version = event.http_version.decode("ascii")
        if version not in ("1.1", "1.0"):
            raise BadRequest(505, f"HTTP/{version} is not supported; expected HTTP/1.1 or HTTP/1.0",
                             head_only=head_only)
        authorization: list[str] = []
        for raw_name, value in event.headers.raw_items():
            name = raw_name.lower()
            if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
                raise BadRequest(413, "request bodies are not accepted", head_only=head_only)
            if name == b"authorization":
                authorization.append(value.decode("latin-1"))
        end = http.next_event()   # a request without a body ends with its head
        if not isinstance(end, h11.EndOfMessage):
            raise BadRequest(400, "malformed request")
    except h11.RemoteProtocolError as exc:
        raise BadRequest(exc.error_status_hint, f"malformed request: {exc}") from None
    target = event.target.decode("ascii")
    if not target.startswith("/"):   # absolute form (or *): keep only the path
        start = target.find("//")
        slash = target.find("/", start + 2) if start >= 0 else -1
        target = target[slash:] if slash >= 0 else "/"
    return Request(event.method.decode("ascii"), target.split("?", 1)[0], f"HTTP/{version}",
                   ", ".join(authorization) if authorization else None)


def frame_response(http: h11.Connection, status: int, body: bytes, content_type: str, *, head_only: bool = False,
                   close: bool = False, extra_headers: tuple[tuple[str, str], ...] = ()) -> bytes:
    """The whole response as h11 frames it, in one buffer (one write, one segment on loopback). `close` asks h11 to
    end the connection after it (`Connection: close`); `http.our_state` then says whether it stays open."""
    headers = [("Content-Type", content_type), ("Content-Length", str(len(body))), *extra_headers]
    if close:
        headers.append(("Connection", "close"))
    parts = [http.send(h11.Response(status_code=status, reason=reason_phrase(status), headers=headers))]
    if body and not head_only:
        parts.append(http.send(h11.Data(data=body)))
    parts.append(http.send(h11.EndOfMessage()))
    return b"".join(p for p in parts if p)


def keeps_alive(http: h11.Connection) -> bool:
    """After a response: the connection serves another request (h11 did not decide to close it)."""
    return http.our_state is h11.DONE


__all__ = ["BadRequest", "Request", "frame_response", "keeps_alive", "new_connection", "next_request",
           "reason_phrase"]
