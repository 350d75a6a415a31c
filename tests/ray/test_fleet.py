"""The Ray router's fleet in-process (no Ray): replicas found by their routing stats, their hooks read from stub hook
exporters on loopback, each prompt routed by the admission core's decision: where it fits, held until room, refused
with the reason; bad settings one line."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from telemetry.admission import Forward, RefusePermanent, RefuseTransient
from telemetry.errors import ConfigError
from telemetry.ray.fleet import Fleet, RouterSettings
from telemetry.ray.replica import hooks_of, routing_stats, upstream_of
from telemetry.ray.request import prompt_size, request_body
from tests.guard.servers import StubHook, exposition

SETTINGS = RouterSettings(queue_s=5.0, stale_s=3.0, timeout_s=1.0)


@pytest.fixture
def hooks() -> Iterator[dict[str, StubHook]]:
    found = {"small": StubHook(lambda: exposition(100_000, node="a", at_best=150_000)),
             "big": StubHook(lambda: exposition(300_000, node="b", at_best=350_000))}
    yield found
    for hook in found.values():
        hook.stop()


def ids(tokens: int) -> Any:
    return prompt_size({"model": "m", "prompt": [1] * tokens})


def run(fleet: Fleet, *coroutines: Any) -> list[Any]:
    async def all_of() -> list[Any]:
        try:
            return list(await asyncio.gather(*coroutines))
        finally:
            await fleet.close()

    return asyncio.run(all_of())


def fleet_of(stats: dict[str, dict[str, Any] | None], settings: RouterSettings = SETTINGS) -> Fleet:
    fleet = Fleet(settings)
    fleet.update(list(stats.items()))
    return fleet


def test_a_prompt_goes_to_the_replica_where_it_fits(hooks: dict[str, StubHook]) -> None:
    fleet = fleet_of({name: routing_stats([hook.url]) for name, hook in hooks.items()})
    decisions = run(fleet, fleet.route(ids(200_000)))
    assert isinstance(decisions[0], Forward) and decisions[0].replica.name == "big"
    assert decisions[0].tokens == 200_000 and fleet.admission is not None


def test_a_prompt_that_fits_no_replica_now_waits_for_a_release_and_goes(hooks: dict[str, StubHook]) -> None:
    fleet = fleet_of({"big": routing_stats([hooks["big"].url])})

    async def two() -> list[Any]:
        first = await fleet.route(ids(200_000))
        second = asyncio.ensure_future(fleet.route(ids(200_000)))
        await asyncio.sleep(0.3)
        assert not second.done()  # 200k held of 300k: the second does not fit beside it
        released = time.monotonic()
        fleet.release(first)
        found = await second
        return [first, found, time.monotonic() - released]

    first, second, after = run(fleet, two())[0]
    assert isinstance(first, Forward) and isinstance(second, Forward) and second.replica.name == "big"
    assert second.queue_outcome == "admitted" and after < 0.5  # woken by the release, not by a poll


def test_a_prompt_no_replica_could_ever_take_is_refused_permanently(hooks: dict[str, StubHook]) -> None:
    fleet = fleet_of({name: routing_stats([hook.url]) for name, hook in hooks.items()})
    decision = run(fleet, fleet.route(ids(400_000)))[0]
    assert isinstance(decision, RefusePermanent) and decision.status == 400
    assert decision.body["error"]["reason"] == "exceeds_memory_at_best"
    assert ("x-should-retry", "false") in decision.headers


def test_a_replica_without_hooks_is_left_out_while_another_has_a_limit(hooks: dict[str, StubHook]) -> None:
    fleet = fleet_of({"bare": {}, "big": routing_stats([hooks["big"].url])})
    decisions = run(fleet, *(fleet.route(ids(1000)) for _ in range(4)))
    assert {d.replica.name for d in decisions} == {"big"}


def test_hooks_that_do_not_answer_are_the_guards_blind_rules_with_the_reason(hooks: dict[str, StubHook]) -> None:
    hooks["big"].down = True
    stats = {"big": routing_stats([hooks["big"].url])}
    admitted = run(fleet := fleet_of(stats), fleet.route(ids(1000)))[0]
    assert isinstance(admitted, Forward) and admitted.counted_by == "blind"  # when_blind admit, as the guard
    refused = run(fleet := fleet_of(stats, RouterSettings(stale_s=3.0, timeout_s=1.0, when_blind="reject")),
                  fleet.route(ids(1000)))[0]
    assert isinstance(refused, RefuseTransient) and refused.status == 503
    assert "answered HTTP 503" in refused.body["error"]["message"]


def test_a_stale_forecast_is_not_used(hooks: dict[str, StubHook]) -> None:
    old = StubHook(lambda: exposition(300_000, node="c", forecast_time=time.time() - 60))
    try:
        refused = run(fleet := fleet_of({"old": routing_stats([old.url])},
                                        RouterSettings(stale_s=3.0, timeout_s=1.0, when_blind="reject")),
                      fleet.route(ids(1000)))[0]
    finally:
        old.stop()
    assert isinstance(refused, RefuseTransient) and "older than 3 s" in refused.body["error"]["message"]


def test_a_replica_that_leaves_serve_leaves_the_pool(hooks: dict[str, StubHook]) -> None:
    fleet = fleet_of({name: routing_stats([hook.url]) for name, hook in hooks.items()})
    fleet.update([("small", routing_stats([hooks["small"].url]))])
    decision = run(fleet, fleet.route(ids(50_000)))[0]
    assert isinstance(decision, Forward) and decision.replica.name == "small"
    assert [r.name for r in fleet.admission.replicas] == ["small"]  # type: ignore[union-attr]


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"hold_s": 1}, "unknown key 'hold_s'; expected queue_s, max_queued"),
    ({"queue_s": -1}, "queue_s: expected a finite number from 0 to 3600, got -1"),
    ({"stale_s": 0}, "stale_s: expected a finite number from 1 to 86400"),
    ({"stale_s": 1e-9}, "stale_s: expected a finite number from 1 to 86400"),   # blind for good, nothing said
    ({"timeout_s": float("nan")}, "timeout_s: expected a finite number"),
    ({"timeout_s": 1e-9}, "timeout_s: expected a finite number from 0.05 to 60"),
    ({"max_queued": 2.5}, "max_queued: expected a whole number from 1 to 100000"),
    ({"max_queued": 0}, "max_queued: expected a whole number from 1 to 100000"),
    ({"reserve_mb": True}, "reserve_mb: expected a finite number"),
    ({"reserve_mb": 1e300}, "reserve_mb: expected a finite number from 0 to 1.67772e+07"),  # refuses everything
    ({"when_blind": "maybe"}, "when_blind: expected 'admit' or 'reject'"),
])
def test_bad_router_kwargs_are_one_line_naming_what_is_expected(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError) as refused:
        RouterSettings.from_kwargs(kwargs)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_routing_stats_name_the_hooks_and_the_engine() -> None:
    stats = routing_stats(["http://10.0.0.1:9200", "http://10.0.0.2:9200"], upstream="http://10.0.0.1:8000/")
    assert hooks_of(stats) == ("http://10.0.0.1:9200", "http://10.0.0.2:9200")
    assert upstream_of(stats) == "http://10.0.0.1:8000"
    assert hooks_of({"memtel_hooks": "http://a:1, http://b:2"}) == ("http://a:1", "http://b:2")
    for bad in (None, {}, {"memtel_hooks": 3}, {"memtel_hooks": [1]}, {"memtel_hooks": []}):
        assert hooks_of(bad) is None


class _Model:
    """Ray Serve LLM's request models dump the fields the client set."""

    def __init__(self, **fields: Any) -> None:
        self.fields = fields

    def model_dump(self, exclude_unset: bool = False) -> dict[str, Any]:
        assert exclude_unset
        return dict(self.fields)


def test_the_body_is_read_from_the_call_as_a_dict_or_a_request_model() -> None:
    assert request_body([{"prompt": "a b"}], {}) == {"prompt": "a b"}
    assert request_body([], {"request": _Model(messages=[{"role": "user", "content": "hi"}])}) == {
        "messages": [{"role": "user", "content": "hi"}]}
    assert request_body([], {}) is None and request_body(["text"], {}) is None
    assert request_body([{"input": "embed me"}], {}) is None  # not a prompt: Ray's default router
    assert prompt_size({"messages": [{"role": "user", "content": "hi"}]}).most_tokens > 2048  # the chat allowance


def test_a_hook_url_that_cannot_be_read_is_said_and_its_replica_is_blind(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="ray.serve"):
        fleet = fleet_of({"bad": {"memtel_hooks": ["http://user@:99999"]}},
                         RouterSettings(stale_s=3.0, timeout_s=1.0, when_blind="reject"))
    assert "routing stats memtel_hooks" in caplog.text and "that hook is not read" in caplog.text
    refused = run(fleet, fleet.route(ids(10)))[0]
    assert isinstance(refused, RefuseTransient) and refused.status == 503
