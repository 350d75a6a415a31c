"""The LiteLLM gate's decisions (telemetry/litellm/gate.py) without LiteLLM, against real loopback servers: stub
engines (tests/guard/servers.py: /tokenize counts words) and hook exporters. It fails closed (unknown models,
unsized routes, bodies it cannot size), asks /tokenize with the deployment's own model, decides again without a
deployment that refuses the connection, and every hold it takes ends once, whatever ends its request."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from telemetry.admission.refusal import Refusal
from telemetry.litellm import client
from telemetry.litellm.gate import Admitted, ClientLeft, Gate, named_deployments
from telemetry.litellm.gauges import GateSettings, GaugeBook
from tests.guard.servers import StubHook, StubUpstream, exposition

SERVED = "served-model-name"
CHAT = "acompletion"


def deployment(name: str, upstream: str, hooks: list[str], group: str = "llm") -> dict[str, Any]:
    """A deployment as configs/litellm/config.yaml ships it: group `llm`, `openai/<served name>`."""
    return {"model_name": group, "litellm_params": {"model": f"openai/{SERVED}", "api_base": f"{upstream}/v1",
                                                     "api_key": "none"},
            "model_info": {"id": name, "memtel_hooks": hooks}}


def chat(words: int, **fields: Any) -> dict[str, Any]:
    return {"model": "llm", "max_tokens": 4, "messages": [{"role": "user", "content": " ".join(["w"] * words)}],
            **fields}


@pytest.fixture
def upstream() -> Iterator[StubUpstream]:
    server = StubUpstream()
    yield server
    server.stop()


@pytest.fixture
def hook() -> Iterator[StubHook]:
    server = StubHook(lambda: exposition(100_000))
    yield server
    server.stop()


def run(job: Callable[[Gate], Awaitable[Any]], settings: GateSettings | None = None) -> Any:
    """`job(gate)` on a fresh loop with a fresh gate, its scrapes stopped afterwards."""
    async def main() -> Any:
        gate = Gate(GaugeBook(settings or GateSettings(stale_s=3, timeout_s=1, hold_s=0)))
        try:
            return await job(gate)
        finally:
            await gate.aclose()

    return asyncio.run(main())


def refused(job: Callable[[Gate], Awaitable[Any]]) -> Refusal:
    with pytest.raises(Refusal) as caught:
        run(job)
    return caught.value


# -- failing closed --------------------------------------------------------------------------------------------

class Router:
    """The two members of LiteLLM's Router the hook reads: `model_list` and `get_model_list(model_name=)` (which
    resolves groups, aliases and wildcards; here the group names)."""

    def __init__(self, deployments: list[dict[str, Any]]) -> None:
        self.model_list = deployments

    def get_model_list(self, model_name: str | None = None) -> list[dict[str, Any]]:
        return [d for d in self.model_list if d["model_name"] == model_name]


def test_a_model_names_its_group_a_deployment_id_or_a_deployments_model() -> None:
    a, b = deployment("a", "http://10.0.0.1:8000", ["http://10.0.0.1:9200"]), deployment("b", "http://h", [])
    hosted = {"model_name": "gpt", "litellm_params": {"model": "openai/gpt-4o"}, "model_info": {"id": "g"}}
    router = Router([a, b, hosted])
    assert named_deployments(router, "llm") == ([a, b], True)
    assert named_deployments(router, "a") == ([a], True)  # the deployment's id: LiteLLM routes it there
    assert named_deployments(router, f"openai/{SERVED}") == ([a, b], True)
    assert named_deployments(router, "nosuch") == ([], True)
    assert named_deployments(Router([hosted]), "gpt") == ([hosted], False)


def test_an_unknown_model_is_refused_where_the_proxy_guards_a_deployment() -> None:
    refusal = refused(lambda gate: gate.decide(CHAT, chat(10, model="labA"), [], any_guarded=True))
    assert refusal.status == 400 and refusal.should_retry is False
    assert refusal.reason == "unknown_model" and "'labA' names no deployment" in str(refusal)
    assert run(lambda gate: gate.decide(CHAT, chat(10), [], any_guarded=False)) is None  # nothing guarded


def test_a_route_the_gate_does_not_size_is_refused_for_a_guarded_deployment(hook: StubHook) -> None:
    guarded = [deployment("a", "http://127.0.0.1:9", [hook.url])]
    for call_type in ("anthropic_messages", "aembedding", "aimage_generation"):
        def job(gate: Gate, c: str = call_type) -> Awaitable[Admitted | None]:
            return gate.decide(c, {"model": "llm", "input": "hi"}, guarded, True)

        refusal = refused(job)
        assert refusal.status == 400 and refusal.reason == "unsized_route" and call_type in str(refusal)
    hosted = [{"model_name": "gpt", "litellm_params": {"model": "openai/gpt-4o"}}]
    assert run(lambda gate: gate.decide("aresponses", {"model": "gpt"}, hosted, True)) is None


def test_a_body_the_gate_cannot_size_is_refused_not_passed(hook: StubHook) -> None:
    """A custom role's message whose content list holds a bare string: vLLM renders it, the gate cannot size it."""
    body = {"model": "llm", "messages": [{"role": "custom", "content": ["3000 words here"]}]}
    refusal = refused(lambda gate: gate.decide(CHAT, body, [deployment("a", "http://127.0.0.1:9", [hook.url])], True))
    assert refusal.status == 400 and refusal.reason == "bad_request" and refusal.body["error"]["param"] == "messages"


# -- /tokenize --------------------------------------------------------------------------------------------------

def test_tokenize_is_asked_with_the_deployments_served_model(upstream: StubUpstream, hook: StubHook) -> None:
    """The shipped config's shape: the client names the group `llm`, the engine serves `served-model-name`."""
    admitted = run(lambda gate: gate.decide(CHAT, chat(50, chat_template="{{ messages }}"),
                                            [deployment("a", upstream.url, [hook.url])], True))
    assert isinstance(admitted, Admitted) and admitted.deployment is not None
    asked = [json.loads(body) for method, path, body in upstream.seen if path == "/tokenize"]
    assert [body["model"] for body in asked] == [SERVED]


def test_tokenize_keeps_its_connections_alive_through_a_burst(upstream: StubUpstream, hook: StubHook) -> None:
    """Four waves of eight prompts that each need /tokenize: eight connections at most, not one per prompt."""
    deployments = [deployment("a", upstream.url, [hook.url])]

    async def burst(gate: Gate) -> list[Admitted | None]:
        answers = []
        for _ in range(4):
            answers += await asyncio.gather(*(gate.decide(CHAT, chat(5, chat_template="x"), deployments, True)
                                              for _ in range(8)))
        return answers

    answers = run(burst)
    assert len(answers) == 32 and all(isinstance(a, Admitted) for a in answers)
    assert sum(path == "/tokenize" for path in upstream.paths()) == 32
    assert len(upstream.connections) <= 8


# -- the pool -----------------------------------------------------------------------------------------------------

def test_a_deployment_that_refuses_the_connection_leaves_the_pool_and_the_prompt_is_decided_again(
        upstream: StubUpstream, hook: StubHook) -> None:
    """The deployment with the most room refuses /tokenize's connection: the prompt goes to the other one; with
    neither left, a 503 `no_replica` with Retry-After."""
    big = StubHook(lambda: exposition(500_000, node="big"))
    try:
        dead = deployment("dead", "http://127.0.0.1:9", [big.url])  # port 9: nothing listens
        alive = deployment("alive", upstream.url, [hook.url])

        async def twice(gate: Gate) -> tuple[Admitted | None, Admitted | None]:
            first = await gate.decide(CHAT, chat(5, chat_template="x"), [dead, alive], True)
            second = await gate.decide(CHAT, chat(5, chat_template="x"), [dead, alive], True)
            return first, second

        first, second = run(twice)
        assert first is not None and first.deployment is alive
        assert second is not None and second.deployment is alive
        assert sum(path == "/tokenize" for path in upstream.paths()) == 2
        refusal = refused(lambda gate: gate.decide(CHAT, chat(5, chat_template="x"), [dead], True))
        assert refusal.status == 503 and refusal.reason == "no_replica" and refusal.retry_after == 5
        assert "refused" in str(refusal) or "ConnectError" in str(refusal)
    finally:
        big.stop()


# -- holds --------------------------------------------------------------------------------------------------------

def held(gate: Gate) -> tuple[int, int, int]:
    """(holds in the gate's book, tokens held, prefills in flight) over its trackers."""
    readings = {id(r.readings): r.readings for r in gate._replicas.values()}
    return (len(gate.held), sum(r.in_prefill_tokens for r in readings.values()),
            sum(r.book.in_flight for r in readings.values()))


async def request(gate: Gate, deployments: list[dict[str, Any]], ending: str) -> tuple[int, int, int]:
    """One request through `ClientWatch` whose app asks the gate, then ends as `ending` says; what the gate held
    while it ran."""
    seen: dict[str, tuple[int, int, int]] = {}
    disconnect = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        if ending == "stream abandoned" and message.get("body"):
            raise OSError("the client is gone")  # the server's send once the connection is lost

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await gate.decide(CHAT, chat(10), deployments, True)
        seen["during"] = held(gate)
        if ending == "error":
            raise RuntimeError("the upstream failed")
        if ending == "client gone":
            disconnect.set()
            await client.left()
            raise asyncio.CancelledError
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    try:
        await client.ClientWatch(app)({"type": "http"}, receive, send)
    except (RuntimeError, OSError, asyncio.CancelledError):
        pass
    return seen["during"]


@pytest.mark.parametrize("ending", ["finish", "error", "client gone", "stream abandoned"])
def test_every_ending_of_a_request_ends_its_hold(upstream: StubUpstream, hook: StubHook, ending: str) -> None:
    deployments = [deployment("a", upstream.url, [hook.url])]

    async def job(gate: Gate) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        during = await request(gate, deployments, ending)
        return during, held(gate)

    during, after = run(job)
    assert during[0] == 1 and during[1] > 0 and during[2] == 1
    assert after == (0, 0, 0)


def test_holds_are_keyed_by_the_gate_and_a_zero_count_is_released(upstream: StubUpstream, hook: StubHook) -> None:
    """Two overlapping prompts get two keys (a client's call id plays no part): releasing one leaves the other's
    tokens; a prompt /tokenize counts 0 is held and released like any other (nothing left in flight)."""
    deployments = [deployment("a", upstream.url, [hook.url])]

    async def job(gate: Gate) -> list[tuple[int, int, int]]:
        first = await gate.decide(CHAT, chat(100), deployments, True)
        second = await gate.decide(CHAT, chat(100), deployments, True)
        assert first is not None and second is not None and first.hold_key != second.hold_key
        states = [held(gate)]
        gate.release(first.hold_key)
        gate.release(first.hold_key)  # a second ending of the same request: nothing more
        states.append(held(gate))
        gate.release(second.hold_key)
        upstream.tokens_per_word = 0
        zero = await gate.decide(CHAT, chat(3, chat_template="x"), deployments, True)
        assert zero is not None and zero.hold_key is not None
        states.append(held(gate))
        gate.release(zero.hold_key)
        states.append(held(gate))
        return states

    both, one, zero, none = run(job)
    assert both[0] == 2 and one[0] == 1 and 0 < one[1] < both[1] and one[2] == 1
    assert zero[:3] == (1, 0, 1)
    assert none == (0, 0, 0)


def test_a_client_that_leaves_a_held_prompt_ends_the_hold() -> None:
    async def job(gate: Gate) -> None:
        hooks = StubHook(lambda: exposition(10))
        try:
            async def gone() -> None:
                await asyncio.sleep(0.05)

            await gate.decide(CHAT, chat(100), [deployment("a", "http://127.0.0.1:9", [hooks.url])], True, gone)
        finally:
            hooks.stop()

    with pytest.raises(ClientLeft):
        run(job, GateSettings(stale_s=3, timeout_s=1, hold_s=5))


def test_a_held_prompt_is_admitted_when_the_hold_ahead_of_it_is_released(upstream: StubUpstream) -> None:
    """The core's queue through the gate: a second prompt that does not fit beside the first waits, is woken by the
    first one's release (not by a poll) and admitted long before its deadline."""
    hooks = StubHook(lambda: exposition(5_000))   # each counted by /tokenize (3,000 words): one fits at a time
    try:
        deployments = [deployment("a", upstream.url, [hooks.url])]

        async def job(gate: Gate) -> tuple[float, Admitted | None]:
            first = await gate.decide(CHAT, chat(3_000), deployments, True)
            assert first is not None
            asyncio.get_running_loop().call_later(0.2, gate.release, first.hold_key)
            started = time.monotonic()
            second = await gate.decide(CHAT, chat(3_000), deployments, True)
            return time.monotonic() - started, second

        waited, second = run(job, GateSettings(stale_s=3, timeout_s=1, hold_s=5))
    finally:
        hooks.stop()
    assert second is not None and second.deployment["model_info"]["id"] == "a"
    assert 0.15 < waited < 1.0


def test_a_deployment_litellm_could_not_reach_leaves_the_pool(upstream: StubUpstream, hook: StubHook) -> None:
    """LiteLLM's failure event names the deployment it could not connect to: the next prompt goes to the other one
    although the first still has the most room by its (fresh) forecast."""
    big = StubHook(lambda: exposition(500_000, node="big"))
    try:
        dead = deployment("dead", upstream.url, [big.url])
        alive = deployment("alive", upstream.url, [hook.url])

        async def job(gate: Gate) -> tuple[str, str]:
            first = await gate.decide(CHAT, chat(10), [dead, alive], True)
            assert first is not None
            gate.release(first.hold_key)
            gate.leave("dead", "LiteLLM could not connect to it")
            second = await gate.decide(CHAT, chat(10), [dead, alive], True)
            assert second is not None
            return first.deployment["model_info"]["id"], second.deployment["model_info"]["id"]

        assert run(job) == ("dead", "alive")
    finally:
        big.stop()


def test_a_deployment_whose_hook_refuses_the_connection_is_decided_around(upstream: StubUpstream,
                                                                            hook: StubHook) -> None:
    """The deployment with the most room: its hook (in its engine's process) stops answering connections; the
    next prompt goes to the other one while the dead one's last forecast still looks fresh."""
    big = StubHook(lambda: exposition(500_000, node="big"))
    stopped = False
    try:
        dead = deployment("dead", upstream.url, [big.url])
        alive = deployment("alive", upstream.url, [hook.url])

        async def job(gate: Gate) -> tuple[str, str]:
            nonlocal stopped
            first = await gate.decide(CHAT, chat(10), [dead, alive], True)
            assert first is not None
            gate.release(first.hold_key)
            big.stop()
            stopped = True
            deadline = time.monotonic() + 3
            while not gate.book.left(gate._replicas["dead"].readings):  # type: ignore[arg-type]
                assert time.monotonic() < deadline, "the dead deployment never left the pool"
                await asyncio.sleep(0.05)
            second = await gate.decide(CHAT, chat(10), [dead, alive], True)
            assert second is not None
            return first.deployment["model_info"]["id"], second.deployment["model_info"]["id"]

        assert run(job, GateSettings(stale_s=1, timeout_s=0.5, hold_s=0)) == ("dead", "alive")
    finally:
        if not stopped:
            big.stop()
