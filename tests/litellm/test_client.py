"""The pre-call hook's view of its client (telemetry/litellm/client.py), without LiteLLM: `ClientWatch` hands each
HTTP request's `receive` to `left()`, which returns when the server says `http.disconnect`; `install` wraps a
started app's middleware stack once, or adds the middleware to one not started."""

from __future__ import annotations

import asyncio
import sys
import types
from typing import Any

import pytest

from telemetry.litellm import client


def channel(*messages: dict[str, Any]) -> Any:
    """An ASGI receive that answers `messages` in order, then waits forever (a client that stays)."""
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for message in messages:
        queue.put_nowait(message)
    return queue.get


async def watched_request(receive: Any, scope_type: str = "http") -> tuple[bool, bool]:
    """(whether the app saw its request watched, whether `left()` returned within 0.05 s) under ClientWatch."""
    seen: dict[str, bool] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen["watched"] = client.watched()
        try:
            await asyncio.wait_for(client.left(), 0.05)
            seen["left"] = True
        except asyncio.TimeoutError:
            seen["left"] = False

    async def send(message: Any) -> None:
        pass

    await client.ClientWatch(app)({"type": scope_type}, receive, send)
    return seen["watched"], seen["left"]


def test_left_returns_when_the_server_says_the_client_disconnected() -> None:
    gone = channel({"type": "http.request", "body": b"", "more_body": False}, {"type": "http.disconnect"})
    assert asyncio.run(watched_request(gone)) == (True, True)


def test_left_waits_while_the_client_stays_and_outside_a_watched_request() -> None:
    assert asyncio.run(watched_request(channel({"type": "http.request", "body": b"", "more_body": False}))) == (
        True, False)  # a message that is not the disconnect is not the client leaving
    assert asyncio.run(watched_request(channel({"type": "http.disconnect"}), "lifespan")) == (False, False)
    assert not client.watched()


class App:
    def __init__(self, stack: Any) -> None:
        self.middleware_stack = stack
        self.user_middleware: list[Any] = []

    def add_middleware(self, cls: type) -> None:
        self.user_middleware.insert(0, types.SimpleNamespace(cls=cls))


def test_install_wraps_a_started_app_once_and_adds_to_one_not_started(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, client.PROXY_MODULE, raising=False)
    assert client.install() is False  # no proxy in this process: nothing to watch
    built = object()
    started = App(built)
    monkeypatch.setitem(sys.modules, client.PROXY_MODULE, types.SimpleNamespace(app=started))
    assert client.install() and client.install()
    assert isinstance(started.middleware_stack, client.ClientWatch) and started.middleware_stack.app is built
    fresh = App(None)
    monkeypatch.setitem(sys.modules, client.PROXY_MODULE, types.SimpleNamespace(app=fresh))
    assert client.install() and client.install()
    assert [m.cls for m in fresh.user_middleware] == [client.ClientWatch] and fresh.middleware_stack is None
