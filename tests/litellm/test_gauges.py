"""The pure parts of memtel's LiteLLM integration, without LiteLLM: settings, the deployments' hooks, the choice
of the deployment with the most room (from real hook answers over loopback), and a refusal as LiteLLM's
ProxyException arguments."""

from __future__ import annotations

import asyncio

import pytest

from telemetry.errors import ConfigError
from telemetry.guard.limit import Limit, LimitTracker, RankFit
from telemetry.guard.refusal import refusal_for
from telemetry.litellm.gauges import GateSettings, GaugeBook, Room, deployment_hooks, roomiest, upstream_root
from telemetry.litellm.refusals import proxy_exception_kwargs
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
    transient = proxy_exception_kwargs(refusal_for(500_000, "words", limit, 1_100_000, "messages"))
    assert transient["code"] == 503
    assert transient["headers"] == {"Retry-After": "10", "x-should-retry": "true"}
    assert transient["provider_specific_fields"]["reason"] == "would_not_fit"
    assert "message" not in transient["provider_specific_fields"]
