"""Where a held prompt waits (telemetry/admission/waiting.py), the one asyncio side of the guard, LiteLLM and Ray:
woken by its core, never polled; many kicks make one pump; a client that leaves ends the wait; nothing is left
running after it."""

from __future__ import annotations

import asyncio
import time

from telemetry.admission import (
    Admission,
    Forward,
    Hold,
    Prompt,
    RankFit,
    Readings,
    ReadModels,
    Replica,
    Settings,
    measure,
)
from telemetry.admission.waiting import HeldPrompts, now
from telemetry.url import parse_url


def replica(tokens: int) -> Replica:
    readings = Readings([parse_url("http://e:9200")], stale_s=30)
    readings.record_at(readings.hooks[0], [RankFit("0", "node", tokens, 4e9, time.time(), (), None)], None, [],
                       time.monotonic(), time.time())
    return Replica("http://e:8000", readings)


def ids(n: int) -> Prompt:
    return Prompt(measure("/v1/completions", {"model": "m", "prompt": [1] * n}))


def held_behind_one(queue_s: float = 10.0) -> tuple[Admission, Forward, Prompt, Hold]:
    core = Admission([replica(1000)], Settings(queue_s=queue_s))
    first = core.decide(ids(800), now())
    waiting = ids(500)
    hold = core.decide(waiting, now())
    if isinstance(hold, ReadModels):   # max-model-len unknown: read as a front door would, then decided again
        core.models_read(hold.replica, {"m": 4096}, now())
        hold = core.decide(waiting, now())
    assert isinstance(first, Forward) and isinstance(hold, Hold)
    return core, first, waiting, hold


async def turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_held_prompt_waits_until_its_core_wakes_it_and_is_then_forwarded() -> None:
    async def scenario() -> None:
        core, first, waiting, hold = held_behind_one()
        held = HeldPrompts(lambda: (core,))
        task = asyncio.create_task(held.wait(waiting, hold.deadline))
        await turns()
        assert not task.done() and held.waiting == 1   # its first pump found no room
        core.release(first, now())
        held.kick()
        assert await asyncio.wait_for(task, 2) is True
        assert held.waiting == 0 and isinstance(core.decide(waiting, now()), Forward)

    asyncio.run(scenario())


def test_many_kicks_make_one_pump_on_the_next_turn() -> None:
    async def scenario() -> None:
        core, _, waiting, hold = held_behind_one()
        asked = []
        wake = core.wake
        core.wake = lambda at: asked.append(at) or wake(at)  # type: ignore[method-assign]
        held = HeldPrompts(lambda: (core,))
        task = asyncio.create_task(held.wait(waiting, hold.deadline))
        await turns()
        before = len(asked)
        for _ in range(50):
            held.kick()
        assert len(asked) == before                          # nothing on the spot
        await turns()
        assert len(asked) == before + 1
        task.cancel()

    asyncio.run(scenario())


def test_a_client_that_leaves_ends_the_wait_and_the_wait_leaves_nothing_running() -> None:
    async def scenario() -> None:
        core, _, waiting, hold = held_behind_one()
        held = HeldPrompts(lambda: (core,))
        started = time.monotonic()
        assert await held.wait(waiting, hold.deadline, asyncio.sleep(0.05)) is False
        assert time.monotonic() - started < 2
        assert await held.wait(waiting, time.monotonic() + 0.05, asyncio.sleep(60)) is True   # the deadline
        await turns()
        assert asyncio.all_tasks() == {asyncio.current_task()}   # the client's watch it made is cancelled
        assert held.waiting == 0

    asyncio.run(scenario())
