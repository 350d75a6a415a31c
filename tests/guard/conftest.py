"""Fixtures the guard's tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.guard.servers import StubUpstream


@pytest.fixture(scope="module")
def upstream() -> Iterator[StubUpstream]:
    """A stub engine for one test module (each module that asks gets its own)."""
    server = StubUpstream()
    yield server
    server.stop()
