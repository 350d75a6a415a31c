"""Whether the client of a request is still there, and what the gate shows of itself.

LiteLLM's proxy hands a pre-call hook the request's data, never its connection, and watches for a client that
leaves only around the upstream call (`general_settings.cancel_on_disconnect`); uvicorn cancels nothing when a
connection is lost. So memtel listens itself: `ClientWatch`, an ASGI middleware put around LiteLLM's app when the
callbacks load (`install`), runs each HTTP request's app call as a task and reads the request's channel for it:
the app's `receive` reads the body; once the body is whole a watcher reads on, and the server's next message,
`http.disconnect`, means the client left. A client that leaves before its answer's last byte gets its app call
cancelled: a held prompt is never sent, and a forwarded one's upstream call is cancelled with it, so the engine
sees its connection close and aborts the prompt (vLLM does) instead of generating for nobody. `left()` returns
when the client left (the pre-call hook waits on it while it holds a prompt).

`on_end(callback)` runs `callback` when the request's app call ends, however it ends (answered, streamed to
the end, abandoned mid-stream, its client gone, cancelled): the gate ends a hold there whatever LiteLLM logs.

The gate's view (`show`, metrics.py): `GET /memtel/metrics` is answered by the middleware with the gate's own
registry, and LiteLLM's `/health*` answers carry `x-memtel-gate-blind: <why>` while a guarded deployment is blind
(the status stays LiteLLM's).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from contextvars import ContextVar
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST

from telemetry.errors import printable

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

_RECEIVE: ContextVar[Receive | None] = ContextVar("memtel_litellm_receive", default=None)
_GONE: ContextVar[asyncio.Event | None] = ContextVar("litellm_client_gone", default=None)
_ENDINGS: ContextVar[list[Callable[[], None]] | None] = ContextVar("memtel_litellm_endings", default=None)
PROXY_MODULE = "litellm.proxy.proxy_server"
METRICS_PATH = "/memtel/metrics"  # the gate's own metrics, served by the middleware
BLIND_HEADER = "x-memtel-gate-blind"  # on /health* answers while a guarded deployment is blind: why
MAX_BLIND_HEADER_CHARS = 1000


class GateView(Protocol):
    """What the middleware shows of the gate (metrics.py's `GateMetrics`)."""

    def exposition(self) -> bytes:
        """The gate's registry in Prometheus' text format."""

    def blind(self) -> str | None:
        """Why a guarded deployment is blind now; None while none is."""


VIEW: GateView | None = None  # the process's gate, as `show` set it


def show(view: GateView) -> None:
    """Serve `view` at METRICS_PATH and in /health's blind header of every `ClientWatch` built without one."""
    global VIEW
    VIEW = view


class ClientWatch:
    """ASGI middleware: each HTTP request's `receive`, for `left()` in the same request; the app cancelled when its
    client leaves before the answer ends; the gate's metrics and blindness shown."""

    def __init__(self, app: App, view: GateView | None = None) -> None:
        self.app = app
        self.view = view  # None: the process's (`show`)

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        view = self.view or VIEW
        if view is not None and scope.get("method") == "GET" and scope.get("path") == METRICS_PATH:
            await _metrics(view, send)
            return
        request = _Request(receive, send, view if str(scope.get("path", "")).startswith("/health") else None)
        token, gone_token = _RECEIVE.set(request.receive), _GONE.set(request.gone)
        endings: list[Callable[[], None]] = []
        ending = _ENDINGS.set(endings)
        task = asyncio.ensure_future(self.app(scope, request.receive, request.send))  # sees both context variables
        gone = asyncio.ensure_future(request.gone.wait())
        try:
            await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and not request.answered:  # the client left before its answer ended: no one reads it
                task.cancel()  # its upstream call too: the engine sees the connection close and aborts the prompt
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return
            await task
        finally:
            for running in (task, gone, request.watcher):
                if running is not None and not running.done():
                    running.cancel()
            _ENDINGS.reset(ending)
            _RECEIVE.reset(token)
            _GONE.reset(gone_token)
            for callback in endings:
                callback()


class _Request:
    """One HTTP request's channel, read by one reader at a time: the app's `receive` reads the body from the server;
    once the body is whole, `watcher` reads on (the server's next message is `http.disconnect`) and the app's
    `receive` waits for it. `gone`: the client left, seen by either. `answered`: the app sent its answer's last
    byte (the server then also says `http.disconnect`, which is no client leaving)."""

    def __init__(self, receive: Receive, send: Send, view: GateView | None) -> None:
        self._receive, self._send, self._view = receive, send, view
        self.gone = asyncio.Event()
        self.answered = False
        self.watcher: asyncio.Task[None] | None = None

    async def receive(self) -> Message:
        if self.watcher is not None:
            await self.gone.wait()
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message.get("type") == "http.disconnect":
            self.gone.set()
        elif message.get("type") == "http.request" and not message.get("more_body", False):
            self.watcher = asyncio.ensure_future(self._watch())
        return message

    async def _watch(self) -> None:
        while (await self._receive()).get("type") != "http.disconnect":
            pass
        self.gone.set()

    async def send(self, message: Message) -> None:
        kind = message.get("type")
        if kind == "http.response.start" and self._view is not None:
            why = self._view.blind()
            if why is not None:
                value = printable(why, MAX_BLIND_HEADER_CHARS).encode("ascii", "backslashreplace")
                message = {**message, "headers": [*message.get("headers", ()), (BLIND_HEADER.encode(), value)]}
        elif kind == "http.response.body" and not message.get("more_body", False):
            self.answered = True  # before the server hears it: its disconnect that follows is no client leaving
        await self._send(message)


async def _metrics(view: GateView, send: Send) -> None:
    body = view.exposition()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode()),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def install() -> bool:
    """Put `ClientWatch` around the LiteLLM proxy's app, if this process runs one; whether it is there.

    LiteLLM loads callbacks inside the app's startup, after Starlette built its middleware stack (too late for
    `add_middleware`): the built stack is wrapped. Imported before any start (`litellm --validate_config`), it
    is added as a middleware."""
    app = getattr(sys.modules.get(PROXY_MODULE), "app", None)
    if app is None or not hasattr(app, "middleware_stack"):
        return False
    stack: App | None = app.middleware_stack
    if isinstance(stack, ClientWatch) or any(getattr(m, "cls", None) is ClientWatch
                                              for m in getattr(app, "user_middleware", ())):
        return True
    if stack is None:
        app.add_middleware(ClientWatch)
    else:
        app.middleware_stack = ClientWatch(stack)
    return True


def watched() -> bool:
    """Whether this request's connection can be watched (it came through `ClientWatch`)."""
    return _RECEIVE.get() is not None


def has_left() -> bool:
    """Whether this request's client has closed its connection (ClientWatch then cancels its app call)."""
    gone = _GONE.get()
    return gone is not None and gone.is_set()


def on_end(callback: Callable[[], None]) -> bool:
    """Run `callback` when this request ends, however; False where it is not watched (nothing will call it)."""
    endings = _ENDINGS.get()
    if endings is None:
        return False
    endings.append(callback)
    return True


async def left() -> None:
    """Returns when this request's client has closed its connection; never, where it cannot be watched."""
    receive = _RECEIVE.get()
    if receive is None:
        await asyncio.Event().wait()
        return
    while (await receive()).get("type") != "http.disconnect":
        pass  # before the body is whole: the server's messages; after it, ClientWatch's watcher says it


__all__ = ["BLIND_HEADER", "METRICS_PATH", "ClientWatch", "GateView", "has_left", "install", "left", "on_end", "show",
           "watched"]
