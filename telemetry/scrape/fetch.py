"""One GET of a /metrics URL from an endpoint that may be hostile: one deadline, a bounded body, whole or refused.

Any local user can listen on an unused default hook port, so whatever answers is read as untrusted: the
request has one deadline for everything (connect, status line, headers, body; a server that sends a byte a
second cannot hold it past the deadline, where a per-read timeout restarts on every byte), the body is capped,
a body shorter than its Content-Length or a chunked body cut short is an error (never parsed as if whole), and
every malformed answer is a `FetchError` with one line of text. HTTP/1.1 framing is the standard library's
(http.client); this module only feeds it a socket whose every read shares the deadline.
"""

from __future__ import annotations

import http.client
import io
import socket
import ssl
import time
from collections.abc import Iterable

from telemetry.catalogue import Family
from telemetry.errors import printable, shown
from telemetry.scrape.reader import Exposition, ExpositionError, parse_body
from telemetry.url import Endpoint, parse_url

MAX_REASON_CHARS = 120   # an endpoint's own words (a status line, a header) in the reason, escaped and cut


class FetchError(Exception):
    """The URL gave no whole, well-formed 200 answer in time; the message is one line saying why."""


class _DeadlineReader(io.RawIOBase):
    """The socket's reads, each allowed only what is left until the deadline."""

    def __init__(self, sock: socket.socket, deadline: float, owner: _DeadlineSocket) -> None:
        self._sock = sock
        self._deadline = deadline
        self._owner = owner

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        if not self.closed:
            self._owner.reader_closed()
        super().close()

    def readinto(self, buffer: memoryview) -> int:   # type: ignore[override]
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _DeadlineSocket:
    """What http.client uses of its socket (sendall, makefile, close), bounded by one deadline. As a socket's
    own makefile, closing it leaves the socket open for a reader still reading (an answer read until close)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline
        self._readers = 0
        self._closed = False

    def sendall(self, data: bytes) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        self._sock.settimeout(left)
        self._sock.sendall(data)

    def makefile(self, mode: str = "rb", *args: object, **kwargs: object) -> io.BufferedReader:
        self._readers += 1
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline, self))

    def reader_closed(self) -> None:
        self._readers -= 1
        if self._closed and not self._readers:
            self._sock.close()

    def close(self) -> None:
        self._closed = True
        if not self._readers:
            self._sock.close()


def _connect(scheme: str, host: str, port: int, deadline: float) -> socket.socket:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    sock = socket.create_connection((host, port), timeout=left)
    if scheme == "https":
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise
    return sock


def _reason(error: BaseException) -> str:
    return printable(" ".join(str(error).split()) or type(error).__name__, MAX_REASON_CHARS)


def get(url: Endpoint | str, deadline: float, max_bytes: int) -> bytes:
    """The body of a 200 answer to GET `url` (http or https; telemetry/url.py), read whole before
    `deadline` (time.monotonic()); FetchError otherwise."""
    endpoint = url if isinstance(url, Endpoint) else parse_url(url)
    host, port = endpoint.host, endpoint.port
    connection = http.client.HTTPConnection(host, port)
    response: http.client.HTTPResponse | None = None
    headers = {"Accept": "text/plain"}
    if endpoint.authorization is not None:
        headers["Authorization"] = endpoint.authorization
    try:
        connection.sock = _DeadlineSocket(_connect(endpoint.scheme, host, port, deadline), deadline)
        connection.request("GET", endpoint.path, headers=headers)
        response = connection.getresponse()
        if response.status != 200:
            raise FetchError(f"HTTP {response.status}")
        if response.length is not None and response.length > max_bytes:
            raise FetchError(f"body of {response.length:,} bytes, over the {max_bytes >> 20} MiB a reader takes")
        chunks: list[bytes] = []
        received = 0
        while chunk := response.read(64 * 1024):
            received += len(chunk)
            if received > max_bytes:
                raise FetchError(f"body over the {max_bytes >> 20} MiB a reader takes")
            chunks.append(chunk)
        if response.length:   # http.client stops quietly at the end of the stream: a Content-Length not met
            raise FetchError(f"body cut short: {received:,} bytes of the {received + response.length:,} its "
                             "Content-Length says")
        return b"".join(chunks)
    except FetchError:
        raise
    except TimeoutError:
        raise FetchError("no whole answer before the deadline") from None
    except http.client.IncompleteRead as error:
        raise FetchError(f"body cut short or badly framed ({len(error.partial):,} bytes, then no valid rest)") \
            from None
    except http.client.RemoteDisconnected:
        raise FetchError("closed the connection without an answer") from None
    except http.client.BadStatusLine as error:
        raise FetchError(f"not an HTTP answer (status line {shown(error.args[0] if error.args else '', 40)})") \
            from None
    except http.client.HTTPException as error:
        raise FetchError(f"malformed HTTP answer ({_reason(error)})") from None
    except ValueError as error:   # a chunk size that is not hex: the chunked body was cut or garbled
        raise FetchError(f"malformed chunked body ({_reason(error)})") from None
    except ssl.SSLError as error:
        raise FetchError(f"TLS: {_reason(error)}") from None
    except OSError as error:
        raise FetchError(printable(error.strerror or str(error) or type(error).__name__, MAX_REASON_CHARS)) from None
    finally:
        if response is not None:
            response.close()
        connection.close()


def read_metrics(url: Endpoint | str, deadline: float, max_bytes: int,
                 only: Iterable[Family] | None = None) -> Exposition:
    """The exposition at `url` (telemetry/scrape/reader.py), read whole before `deadline`; FetchError (one line)
    for an endpoint that cannot be read or answers anything but a whole /metrics body."""
    try:
        return parse_body(get(url, deadline, max_bytes), only)
    except ExpositionError as error:
        raise FetchError(str(error)) from None


__all__ = ["FetchError", "get", "read_metrics"]
