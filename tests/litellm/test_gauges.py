"""The pure parts of memtel's LiteLLM integration, without LiteLLM: settings, the deployments' hooks, the choice
of the deployment with the most room (from real hook answers over loopback), and a refusal as LiteLLM's
ProxyException arguments."""

from __future__ import annotations

import asyncio
import time

import pytest

from telemetry.admission.refusal import refusal_for
from telemetry.errors import ConfigError
from telemetry.guard.limit import MAX_METRICS_BYTES, Limit, LimitTracker, RankFit
from telemetry.litellm.gauges import GateSettings, GaugeBook, Room, deployment_hooks, roomiest, scrape, upstream_root
from telemetry.litellm.refusals import proxy_exception_kwargs
from telemetry.url import parse_url
from tests.guard.servers import StubHook, exposition


def deployment(name: str, hooks: object, api_base: str = "http://10.0.0.1:8000/v1") -> dict[str, object]:
    return {"model_name": "m", "litellm_params": {"model": "openai/m", "api_base": api_base},
            "model_info": {"id": name, "memtel_hooks": hooks}}


def room(name: str, tokens: int | None) -> Room:
    tracker = LimitTracker([], stale_s=15)
    fit = RankFit("0", name, tokens or 0, 8 << 30, 0.0)
    limit = None if tokens is None else Limit(tokens, tokens, 0, fit, f"http://{name}:9200/metrics")
    return Room(deployment(name, []), tracker, limit)


def chosen(rooms: list[Room], tokens: int) -> object:
    found = roomiest(rooms, tokens)
    return None if found is None else found.deployment["model_info"]["id"]


def test_settings_from_env_and_bad_values() -> None:
    assert GateSettings.from_env({}) == GateSettings()
    settings = GateSettings.from_env({"MEMTEL_LITELLM_HOLD_S": "2.5", "MEMTEL_LITELLM_STALE_S": "6"})
    assert (settings.hold_s, settings.stale_s, settings.poll_s) == (2.5, 6.0, 1.0)
    for variable, value in (("MEMTEL_LITELLM_HOLD_S", "-1"), ("MEMTEL_LITELLM_STALE_S", "0"),
                            ("MEMTEL_LITELLM_RESERVE_MB", "nan"), ("MEMTEL_LITELLM_TIMEOUT_S", "soon")):
        with pytest.raises(ConfigError, match=variable):
            GateSettings.from_env({variable: value})


@pytest.mark.parametrize(("variable", "value", "expected"), [
    ("MEMTEL_LITELLM_STALE_S", "1e-9", "seconds from 1 to 86400 (default 15)"),
    ("MEMTEL_LITELLM_TIMEOUT_S", "1e-9", "seconds from 0.05 to 60 (default 2)"),
    ("MEMTEL_LITELLM_RESERVE_MB", "1e300", "MiB from 0 to 1.67772e+07 (default 0)"),
    ("MEMTEL_LITELLM_HOLD_S", "inf", "seconds from 0 to 3600 (default 10)")])
def test_settings_that_would_turn_the_gate_off_or_refuse_all_are_refused(variable: str, value: str,
                                                                         expected: str) -> None:
    """A staleness or timeout of a nanosecond keeps every hook stale (the gate blind, so off); a reserve of 1e300
    MiB refuses everything: each is one line naming the variable, the value and the range."""
    with pytest.raises(ConfigError) as caught:
        GateSettings.from_env({variable: value})
    assert str(caught.value) == f"{variable}='{value}': expected a number of {expected}"


def test_deployment_hooks_and_upstream_root() -> None:
    hooks = deployment_hooks(deployment("a", ["http://10.0.0.1:9200", "http://10.0.0.2:9200/metrics"]))
    assert [h.url for h in hooks] == ["http://10.0.0.1:9200/metrics", "http://10.0.0.2:9200/metrics"]
    assert [h.url for h in deployment_hooks(deployment("a", "http://h1:9200,http://h2:9200"))] == [
        "http://h1:9200/metrics", "http://h2:9200/metrics"]
    assert deployment_hooks({"litellm_params": {}}) == ()
    with pytest.raises(ConfigError, match="memtel_hooks"):
        deployment_hooks(deployment("a", {"url": "x"}))
    with pytest.raises(ConfigError, match=r"^model_info\.memtel_hooks: 'ftp://x' is not a metrics URL"):
        deployment_hooks(deployment("a", ["ftp://x"]))
    assert upstream_root(deployment("a", [], "http://10.0.0.1:8000/v1/")) == "http://10.0.0.1:8000"
    assert upstream_root({"litellm_params": {}}) is None


def test_roomiest_takes_the_most_room_where_the_prompt_fits() -> None:
    rooms = [room("small", 270_000), room("blind", None), room("big", 532_000)]
    assert chosen(rooms, 1_000) == "big"
    assert chosen(rooms, 400_000) == "big"
    assert chosen(rooms, 600_000) is None
    assert roomiest([room("blind", None)]) is None
    assert roomiest(rooms[:1], 270_000) is not None  # exactly the limit fits


def test_gauge_book_reads_each_deployments_hook() -> None:
    """Two real hook endpoints over loopback: the book's rooms carry each one's limit, the biggest is chosen."""
    small, big = StubHook(lambda: exposition(270_000, node="small")), StubHook(lambda: exposition(532_000, node="big"))
    try:
        async def main() -> list[Room]:
            book = GaugeBook(GateSettings(stale_s=3, timeout_s=1))
            try:
                return await book.rooms([deployment("s", [small.url]), deployment("b", [big.url]),
                                         deployment("none", None)])
            finally:
                book.close()

        rooms = asyncio.run(main())
    finally:
        small.stop()
        big.stop()
    assert [r.limit.tokens if r.limit else None for r in rooms] == [270_000, 532_000]
    assert chosen(rooms, 300_000) == "b"


def test_a_permanent_refusal_maps_to_a_400_that_says_no_retry() -> None:
    limit = room("vm", 401_244).limit
    assert limit is not None
    permanent = proxy_exception_kwargs(refusal_for(1_200_000, "words", limit, 1_100_000, "messages"))
    assert permanent["code"] == 400 and permanent["type"] == "invalid_request_error"
    assert permanent["headers"] == {"x-should-retry": "false"}
    assert permanent["param"] == "messages"
    assert permanent["provider_specific_fields"]["code"] == "context_length_exceeded"
    assert permanent["provider_specific_fields"]["prompt_tokens"] == 1_200_000
    assert permanent["message"].startswith("memtel's LiteLLM gate: ") and "memtel guard" not in permanent["message"]
    transient = proxy_exception_kwargs(refusal_for(500_000, "words", limit, 1_100_000, "messages"))
    assert transient["code"] == 503
    assert transient["headers"] == {"Retry-After": "10", "x-should-retry": "true"}
    assert transient["provider_specific_fields"]["reason"] == "would_not_fit"
    assert "message" not in transient["provider_specific_fields"]
    assert transient["message"].startswith("memtel's LiteLLM gate: the prompt has at least 500,000 tokens")


# -- reading hooks -------------------------------------------------------------------------------------------------

class RawHook:
    """A hook exporter that answers as a test says, on the test's own loop: `trickle` (its head, then a byte every
    0.1 s, forever: every single read is quick) or `flood` (a head saying 500 MB, then 64 KiB chunks until the
    reader stops). `written`: the body bytes it got out."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.written = 0
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._answer, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 500000000\r\n\r\n")
            piece = b"#" * (64 << 10) if self.mode == "flood" else b"#"
            while self.written < 500_000_000:
                writer.write(piece)
                await writer.drain()
                self.written += len(piece)
                if self.mode == "trickle":
                    await asyncio.sleep(0.1)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def test_one_slow_hook_of_two_does_not_blind_its_deployment() -> None:
    """A deployment's two ranks: one hook trickles its answer a byte at a time for ever. The other is read every
    poll all the same, and the slow one fails by the whole answer's deadline."""
    good = StubHook(lambda: exposition(270_000, node="good"))
    slow = RawHook("trickle")
    try:
        async def main() -> tuple[float, str | None, Limit | None]:
            book = GaugeBook(GateSettings(stale_s=1, timeout_s=0.3))
            try:
                rooms = await book.rooms([deployment("d", [good.url, await slow.start()])])
                tracker = rooms[0].tracker
                await asyncio.sleep(1.5)  # past the staleness
                fast, trickling = tracker.hooks
                assert fast.scraped_at is not None
                return time.monotonic() - fast.scraped_at, trickling.error, tracker.limit()
            finally:
                book.close()
                slow.close()

        age, error, limit = asyncio.run(main())
    finally:
        good.stop()
    assert age < 0.8
    assert error is not None and "no whole answer in time" in error
    assert limit is not None and limit.tokens == 270_000


def test_a_500_mb_hook_answer_is_cut_while_it_is_read() -> None:
    flood = RawHook("flood")

    async def main() -> tuple[str | None, float]:
        tracker = LimitTracker([parse_url(await flood.start())], stale_s=15)
        started = time.monotonic()
        try:
            await scrape(tracker, tracker.hooks[0], timeout_s=30)
        finally:
            flood.close()
        return tracker.hooks[0].error, time.monotonic() - started

    error, took = asyncio.run(main())
    assert error is not None and f"more than {MAX_METRICS_BYTES} bytes" in error
    assert flood.written < MAX_METRICS_BYTES + (16 << 20)  # what the sockets' buffers hold past the cut
    assert took < 5


def test_an_absurd_gauge_is_left_out_and_said_not_raised() -> None:
    """1e308 tokens and bytes (with a reserve, the guard's scaling would overflow): the rank is left out, the
    deployment is blind and says why, and the scrapes go on."""
    absurd = StubHook(lambda: exposition(int(1e308), budget=1e308))
    try:
        async def main() -> tuple[Limit | None, str, int]:
            book = GaugeBook(GateSettings(stale_s=1, timeout_s=1, reserve_mb=1))
            try:
                rooms = await book.rooms([deployment("d", [absurd.url])])
                scrapes = absurd.scrapes
                await asyncio.sleep(book.settings.poll_s * 2.5)
                return rooms[0].limit, rooms[0].tracker.why_blind(), absurd.scrapes - scrapes
            finally:
                book.close()

        limit, why, later = asyncio.run(main())
    finally:
        absurd.stop()
    assert limit is None
    assert "memtel_forecast_max_prefill_tokens is 1e+308" in why and "memtel_forecast_fit_budget_bytes is 1e+308" in why
    assert later >= 2


def test_a_hook_that_refuses_the_connection_takes_its_deployment_out_of_the_pool() -> None:
    hook = StubHook(lambda: exposition(270_000))
    stopped = False
    try:
        async def main() -> tuple[str | None, str | None]:
            nonlocal stopped
            book = GaugeBook(GateSettings(stale_s=3, timeout_s=0.5))
            try:
                before = (await book.rooms([deployment("d", [hook.url])]))[0]
                hook.stop()
                stopped = True
                deadline = time.monotonic() + 3
                while (after := (await book.rooms([deployment("d", [hook.url])]))[0]).left is None:
                    assert time.monotonic() < deadline, "the deployment never left the pool"
                    await asyncio.sleep(0.05)
                assert after.limit is not None  # its last forecast still looked fresh: the pool, not staleness
                return before.left, after.left
            finally:
                book.close()

        before, after = asyncio.run(main())
    finally:
        if not stopped:
            hook.stop()
    assert before is None and after is not None and "refused the connection" in after
    assert roomiest([Room(deployment("d", []), LimitTracker([], stale_s=3), room("d", 1000).limit, after)]) is None
