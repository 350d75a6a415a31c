"""Fixtures the guard's tests share."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.guard.servers import RunningGuard, StubUpstream


@pytest.fixture(scope="module")
def upstream() -> Iterator[StubUpstream]:
    """A stub engine for one test module (each module that asks gets its own)."""
    server = StubUpstream()
    yield server
    server.stop()


@pytest.fixture
def start_guard(upstream: StubUpstream) -> Iterator[Callable[..., RunningGuard]]:
    """`start(hooks, ready=..., **RunningGuard options)`: a guard in front of `upstream` for one test, returned once
    `ready(guard)` holds (default: a limit published); stopped at the test's end, the upstream's held answers let go
    first."""
    started: list[RunningGuard] = []

    def start(hooks: list[str], *, ready: Callable[[RunningGuard], Any] | None = None,
              **options: Any) -> RunningGuard:
        running = RunningGuard(upstream.url, hooks, **options)
        started.append(running)
        running.wait_for(lambda: (ready or (lambda g: g.tracker.published is not None))(running))
        return running

    yield start
    if upstream.hold is not None:
        upstream.hold.set()
    for running in started:
        running.stop()
