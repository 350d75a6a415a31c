"""Whether the client of a prompt held in the pre-call hook is still there.

LiteLLM's proxy hands a pre-call hook the request's data, never its connection, and watches for a client that
leaves only around the upstream call (`general_settings.cancel_on_disconnect`); uvicorn cancels nothing when a
connection is lost. A prompt held in the hook would wait out MEMTEL_LITELLM_HOLD_S for nobody, then go upstream
if room came. So the hook listens itself: `ClientWatch`, an ASGI middleware put around LiteLLM's app when the
callbacks load (`install`), keeps each HTTP request's `receive` in a context variable, and `left()` waits on it
for `http.disconnect`, which the server answers once the connection is lost. The hook calls it only while it
holds a prompt, after LiteLLM has read the whole body: nothing else is taken from the channel.

`on_end(callback)` runs `callback` when the request's app call ends, however it ends (answered, streamed to
the end, abandoned mid-stream, its client gone, cancelled): the gate ends a hold there whatever LiteLLM logs.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from contextvars import ContextVar
from typing import Any

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

_RECEIVE: ContextVar[Receive | None] = ContextVar("memtel_litellm_receive", default=None)
_ENDINGS: ContextVar[list[Callable[[], None]] | None] = ContextVar("memtel_litellm_endings", default=None)
PROXY_MODULE = "litellm.proxy.proxy_server"


class ClientWatch:
    """ASGI middleware: each HTTP request's `receive`, for `left()` in the same request."""

    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        token = _RECEIVE.set(receive)
        endings: list[Callable[[], None]] = []
        ending = _ENDINGS.set(endings)
        try:
            await self.app(scope, receive, send)
        finally:
            _ENDINGS.reset(ending)
            _RECEIVE.reset(token)
            for callback in endings:
                callback()


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
        pass


__all__ = ["ClientWatch", "install", "left", "on_end", "watched"]
