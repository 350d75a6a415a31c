"""The pre-call hook's view of its client (telemetry/litellm/client.py), without LiteLLM: `ClientWatch` hands each
HTTP request's `receive` to `left()`, which returns when the server says `http.disconnect`; `install` wraps a
started app's middleware stack once, or adds the middleware to one not started."""

from __future__ import annotations

import asyncio
import sys
import time
import types
from typing import Any

import pytest

from telemetry.litellm import client
from telemetry.litellm.gate import Admitted, ClientLeft, Gate
from telemetry.litellm.gauges import GateSettings, GaugeBook
from tests.guard.servers import StubHook, exposition


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


# -- a client that leaves: the app call cancelled, its hold released ---------------------------------------------

class Client:
    """An ASGI server's channel for one request: its body, then, once told to (`leave`), `http.disconnect`; what
    the app sent."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.left_at: float | None = None
        self._gone = asyncio.Event()
        self._body_sent = False

    async def receive(self) -> dict[str, Any]:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": b'{"model": "llm"}', "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    def leave(self) -> None:
        self.left_at = time.monotonic()
        self._gone.set()

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


SCOPE = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}


def test_a_client_that_leaves_a_forwarded_request_cancels_its_upstream_call_and_ends_its_hold() -> None:
    """The app (as LiteLLM: reads the body, the gate admits and holds, then awaits the upstream's answer) is
    cancelled within 0.5 s of the client leaving, and the gate's book is empty afterwards."""
    hook = StubHook(lambda: exposition(100_000))
    seen: dict[str, Any] = {}

    async def main() -> None:
        gate = Gate(GaugeBook(GateSettings(stale_s=3, timeout_s=1, hold_s=0)))
        guarded = {"model_name": "llm", "litellm_params": {"model": "openai/m", "api_base": "http://127.0.0.1:9/v1"},
                   "model_info": {"id": "a", "memtel_hooks": [hook.url]}}
        chat = {"model": "llm", "messages": [{"role": "user", "content": "w " * 10}]}
        person = Client()

        async def app(scope: Any, receive: Any, send: Any) -> None:
            while (await receive()).get("more_body"):
                pass
            seen["admitted"] = await gate.decide("acompletion", chat, [guarded], True)
            seen["held"] = len(gate.held)
            asyncio.get_running_loop().call_later(0.1, person.leave)
            try:
                await asyncio.sleep(30)  # the upstream's answer, a long generation
            except asyncio.CancelledError:
                seen["cancelled_after"] = time.monotonic() - (person.left_at or 0)
                raise

        try:
            await asyncio.wait_for(client.ClientWatch(app)(SCOPE, person.receive, person.send), 2)
            seen["book"] = dict(gate.held)
        finally:
            await gate.aclose()

    try:
        asyncio.run(main())
    finally:
        hook.stop()
    assert isinstance(seen["admitted"], Admitted) and seen["held"] == 1
    assert seen["cancelled_after"] < 0.5 and seen["book"] == {}


def test_the_servers_disconnect_after_the_answer_cancels_nothing() -> None:
    """A server says `http.disconnect` once the answer's last byte is sent: what the app does after it (Starlette's
    background tasks: LiteLLM's logging) runs to its end."""
    person = Client()
    done: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})
        person.leave()
        await asyncio.sleep(0.2)
        done.append("after the answer")

    asyncio.run(client.ClientWatch(app)(SCOPE, person.receive, person.send))
    assert done == ["after the answer"] and [m["type"] for m in person.sent] == ["http.response.start",
                                                                                 "http.response.body"]



def test_a_client_that_leaves_a_held_prompt_is_said_as_left_whichever_wakes_first() -> None:
    """A prompt held in the gate when its client leaves: the gate's `left()` and the middleware's cancel both see
    it; either way the pre-call hook gets ClientLeft (its one log line, LiteLLM's 499), within 0.5 s, and the
    core's queue and the book are empty. Ten times: both orders occur."""
    hook = StubHook(lambda: exposition(10))
    outcomes: list[tuple[str, float, int, int]] = []

    async def main() -> None:
        gate = Gate(GaugeBook(GateSettings(stale_s=3, timeout_s=1, hold_s=5)))
        guarded = {"model_name": "llm", "litellm_params": {"model": "openai/m", "api_base": "http://127.0.0.1:9/v1"},
                   "model_info": {"id": "a", "memtel_hooks": [hook.url]}}
        chat = {"model": "llm", "messages": [{"role": "user", "content": "w " * 100}]}
        try:
            await gate.book.rooms([guarded])  # the hook answered: each prompt below is held when its client leaves
            for _ in range(10):
                person = Client()

                async def app(scope: Any, receive: Any, send: Any, person: Client = person) -> None:
                    await receive()
                    asyncio.get_running_loop().call_later(0.05, person.leave)
                    await gate.decide("acompletion", chat, [guarded], True)

                try:
                    await asyncio.wait_for(client.ClientWatch(app)(SCOPE, person.receive, person.send), 2)
                    outcome = "returned"
                except ClientLeft:
                    outcome = "left"
                except asyncio.CancelledError:
                    outcome = "cancelled"
                queued = sum(a.queued for a in gate._admissions.values())
                outcomes.append((outcome, time.monotonic() - (person.left_at or 0), queued, len(gate.held)))
        finally:
            await gate.aclose()

    try:
        asyncio.run(main())
    finally:
        hook.stop()
    assert all(outcome == "left" and after < 0.5 and queued == 0 and held == 0
               for outcome, after, queued, held in outcomes), outcomes
