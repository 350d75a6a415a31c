"""Fixtures for the hook tests: throw-away modules to hook, and no hook (nor forecast setting) left behind by a test."""

from __future__ import annotations

import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from telemetry.fit_budget import set_forecast_budget
from telemetry.hook import active_handle, set_allocator_source
from telemetry.hook.forecast import set_forecast_workload


@pytest.fixture(autouse=True)
def _no_hook_left_behind() -> Iterator[None]:
    """No hook, allocator source, program workload or program budget outlives its test."""
    yield
    handle = active_handle()
    if handle is not None:
        handle.uninstall()
    set_allocator_source(None)
    set_forecast_workload(None)
    set_forecast_budget(None)


@pytest.fixture
def make_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., str]]:
    """make_module(source, package=None) -> unique module name, importable from tmp_path (not imported yet)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    created: list[str] = []

    def make(source: str, package: str | None = None) -> str:
        name = "memtel_test_" + uuid.uuid4().hex[:10]
        folder = tmp_path
        if package is not None:
            folder = tmp_path / package
            folder.mkdir(exist_ok=True)
            init = folder / "__init__.py"
            if not init.exists():
                init.write_text("")
        (folder / f"{name}.py").write_text(textwrap.dedent(source))
        full = f"{package}.{name}" if package else name
        created.append(full)
        return full

    yield make
    for name in created:
        sys.modules.pop(name, None)
