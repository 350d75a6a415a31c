"""memtel's request router in a real Ray Serve (.venv-ray, a local Ray cluster) in front of lab engines, met by the
OpenAI Python client: prompts go where they fit, wait when none has room, and a prompt no replica can ever take is a
`BadRequestError`; the same burst through Ray's default router runs an engine out of memory.

One Ray cluster and four lab nodes per module (tests/ray/stack.py; 14 to 28 s to start here, 3 to 4 s to stop), so
the module is `slow`. The router reads each hook and engine every second (its default `stale_s`, 15, over 3, capped
at 1 s: fleet.RouterSettings.poll_s): after a hook's gauge moves, a test waits two of those reads (`router_sees`)
before it sends, as a client of a real fleet would meet it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from harness.demo.guarded import prompt_text
from telemetry.catalogue.metrics import FORECAST_MAX_PREFILL_TOKENS
from telemetry.scrape.reader import parse
from tests.ray.stack import RAY_PYTHON, RayStack, burst

pytestmark = pytest.mark.slow

ROUTER_POLL_S = 1.0  # the router's read period (fleet.RouterSettings.poll_s)
LONG = 300_000  # fits an idle node (about 401k tokens) alone; not beside the tenant below (163k on a fresh node,
# 254k on one whose cache holds two such prefills: the tenant then gets 0.56 GiB), nor beside another
TENANT_GIB = 0.9  # leaves about 163k tokens on a 1.5 GiB node
NEVER = 1_048_576  # over what a node takes at best, within max-model-len (1,100,000)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayStack]:
    if not RAY_PYTHON.exists():
        pytest.fail(f"{RAY_PYTHON} is missing: scripts/test builds it (scripts/lib/setup.sh ensure_ray_venv)")
    found = RayStack(tmp_path_factory.mktemp("ray"))
    try:
        found.start()
        print(f"the Ray fleet started in {found.start_s:.1f} s")
        yield found
    finally:
        found.stop()


def gauge(stack: RayStack, app: str, index: int) -> float | None:
    hook = stack.engines[app][index][1]
    try:
        return parse(httpx.get(f"http://127.0.0.1:{hook}/metrics", timeout=5).text).total(FORECAST_MAX_PREFILL_TOKENS)
    except httpx.HTTPError:
        return None


def router_sees(stack: RayStack, app: str, index: int, below: bool) -> None:
    """Wait until the engine's hook says a LONG prompt fits (below=False) or does not (below=True), then two of the
    router's reads of it."""
    seen: list[float | None] = []

    def there() -> bool:
        seen.append(gauge(stack, app, index))
        return seen[-1] is not None and (seen[-1] < LONG) == below

    stack.wait(there, f"{app}-{index}'s gauge {'below' if below else 'above'} {LONG} (it reads {seen[-1:]})")
    time.sleep(2 * ROUTER_POLL_S)


def tenants(stack: RayStack, where: list[tuple[str, int]], gib: float) -> None:
    for app, index in where:
        stack.tenant(app, index, gib)
    for app, index in where:
        router_sees(stack, app, index, below=gib > 0)


def fresh(stack: RayStack, *nodes: tuple[str, int]) -> None:
    for app, index in nodes:
        stack.restart(app, index)


def test_a_tenant_on_one_replica_moves_long_prompts_to_the_other(stack: RayStack) -> None:
    tenants(stack, [("memtel", 0)], TENANT_GIB)
    outcomes = burst(stack.url("memtel"), LONG, 2, seed=10)
    assert [o[0] for o in outcomes] == ["ok", "ok"], outcomes
    assert {o[1] for o in outcomes} == {stack.engine_url("memtel", 1)}, outcomes
    assert stack.oom_lines("memtel", 0) == [] and stack.oom_lines("memtel", 1) == []


def test_when_no_replica_has_room_the_prompts_wait_and_all_complete(stack: RayStack) -> None:
    both = [("memtel", 0), ("memtel", 1)]
    fresh(stack, *both)
    tenants(stack, both, TENANT_GIB)
    before = [stack.prompt_tokens(*w) for w in both]
    outcomes: list[tuple[str, str, float]] = []
    sender = threading.Thread(target=lambda: outcomes.extend(burst(stack.url("memtel"), LONG, 3, seed=40)))
    started = time.monotonic()
    sender.start()
    stack.wait(lambda: time.monotonic() - started > 2 * ROUTER_POLL_S, "the prompts to be held")
    assert [stack.prompt_tokens(*w) for w in both] == before  # none reached an engine while none had room
    for app, index in both:
        stack.tenant(app, index, 0)
    released = time.monotonic() - started
    sender.join(120)
    assert [o[0] for o in outcomes] == ["ok"] * 3, outcomes
    assert min(o[2] for o in outcomes) >= released - 0.5  # each waited for the room (its clock started later)
    assert sum(stack.prompt_tokens(*w) for w in both) - sum(before) == 3 * LONG
    assert stack.oom_lines("memtel", 0) == [] and stack.oom_lines("memtel", 1) == []


def test_a_prompt_no_replica_can_ever_take_is_a_bad_request_error_at_once(stack: RayStack) -> None:
    before = [stack.prompt_tokens("memtel", i) for i in (0, 1)]
    started = time.perf_counter()
    with openai.OpenAI(base_url=stack.url("memtel"), api_key="none", timeout=60) as client, \
            pytest.raises(openai.BadRequestError) as refused:  # the SDK's retries on: a 400 is not retried
        client.completions.create(model="lab", prompt=prompt_text(NEVER, 7), max_tokens=4)
    assert time.perf_counter() - started < 3.0
    error = refused.value.body
    assert isinstance(error, dict)
    assert error.get("code") == "context_length_exceeded" and error.get("reason") == "exceeds_memory_at_best", error
    assert refused.value.response.headers.get("x-should-retry") == "false"
    assert [stack.prompt_tokens("memtel", i) for i in (0, 1)] == before


def test_the_same_burst_through_rays_default_router_runs_an_engine_out_of_memory(stack: RayStack) -> None:
    fresh(stack, ("memtel", 0), ("memtel", 1))
    tenants(stack, [("memtel", 0), ("default", 0)], TENANT_GIB)
    found: dict[str, list[tuple[str, str, float]]] = {}
    senders = [threading.Thread(target=lambda app=app: found.__setitem__(app, burst(stack.url(app), LONG, 4, seed=60)))
               for app in ("memtel", "default")]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(150)
    print("memtel:", found["memtel"], "default:", found["default"])
    assert [o[0] for o in found["memtel"]] == ["ok"] * 4, found["memtel"]
    assert {o[1] for o in found["memtel"]} == {stack.engine_url("memtel", 1)}
    assert stack.oom_lines("memtel", 0) == [] and stack.oom_lines("memtel", 1) == []
    # Ray's router balances queue lengths: the node the tenant holds gets its share, and runs out of memory.
    assert [o[0] for o in found["default"]].count("ok") < 4, found["default"]
    assert stack.oom_lines("default", 0) != []


def test_a_replica_whose_engine_dies_leaves_the_routing(stack: RayStack) -> None:
    fresh(stack, ("memtel", 0))
    tenants(stack, [("memtel", 0)], TENANT_GIB)  # the engine that dies has the most room when it dies
    before = burst(stack.url("memtel"), 1000, 2, seed=70)  # the router has read it alive
    assert {o[1] for o in before} == {stack.engine_url("memtel", 1)}, before
    stack.nodes[("memtel", 1)].stop(grace_s=0.0)
    time.sleep(2 * ROUTER_POLL_S)  # the router reads each engine's /health every poll: it leaves the pool (its hook's
    # last forecast stays fresh for stale_s, 15 s: without the /health read, prompts would still go there)
    outcomes = burst(stack.url("memtel"), 1000, 4, seed=80)
    assert [o[0] for o in outcomes] == ["ok"] * 4, outcomes
    assert {o[1] for o in outcomes} == {stack.engine_url("memtel", 0)}

