"""The guard parses a hook's answer off the event loop that serves its clients (telemetry/guard/limit.py,
scrape_forever): while a /metrics body is being parsed, the loop keeps running.

The parse is held until the loop has ticked once more after the parse began; parsed on the loop, that tick can
never come, and the parse gives up after a second and says so.
"""

from __future__ import annotations

import asyncio
import threading

from telemetry.guard import limit
from telemetry.guard.limit import LimitTracker, scrape_forever
from telemetry.url import parse_url
from tests.guard.servers import StubHook, exposition


def test_a_hooks_answer_is_parsed_while_the_loop_keeps_running(monkeypatch):
    parse = limit.parse_hook
    ticks = 0
    ticked_during_parse: list[bool] = []
    loop_threads: list[bool] = []
    loop_thread: threading.Thread | None = None

    def held_parse(text: str):
        started_at = ticks
        ticked = threading.Event()
        for _ in range(100):  # at most a second
            if ticks > started_at + 1:
                ticked.set()
                break
            ticked.wait(0.01)
        ticked_during_parse.append(ticked.is_set())
        loop_threads.append(threading.current_thread() is loop_thread)
        return parse(text)

    monkeypatch.setattr(limit, "parse_hook", held_parse)
    # A large answer: a hook with many ranks' series (about 300 kB), as a big node's would be.
    hook = StubHook(lambda: exposition(1000) + "".join(
        f'memtel_hook_calls_total{{site="s{i}",rank="0",node="node-a"}} {i}.0\n' for i in range(5_000)))
    tracker = LimitTracker([parse_url(hook.url)], stale_s=30.0)

    async def main() -> None:
        nonlocal ticks, loop_thread
        loop_thread = threading.current_thread()
        scraper = asyncio.ensure_future(scrape_forever(tracker, 0.05, timeout_s=5.0))
        try:
            for _ in range(1000):
                if tracker.hooks[0].fits or tracker.hooks[0].error:
                    break
                ticks += 1
                await asyncio.sleep(0.005)
        finally:
            scraper.cancel()
            await asyncio.gather(scraper, return_exceptions=True)

    try:
        asyncio.run(main())
    finally:
        hook.stop()
    assert tracker.hooks[0].error is None and tracker.hooks[0].fits, tracker.hooks[0].error
    assert ticked_during_parse[0], "the event loop stood still while the hook's answer was parsed"
    assert loop_threads[0] is False
