"""Tests that need one of memtel's optional extras skip, with a reason, where it is not installed.

The core install (`pip install memtel`) runs the hook, the daemon and the GPU tests; the `harness` extra adds
the A/B harness, its report and the lab server (httpx, rich, matplotlib, numpy) and the `auth` extra the
web config's bcrypt hashes. scripts/test installs every extra, so nothing here skips in its run; on a CUDA
machine with torch and the core dependencies only, `pytest -m gpu` still collects (tests/conftest.py turns a
test module's import of a missing extra into a skip of that module) and runs what it can.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import pytest

# The top-level module -> the extra of pyproject.toml that installs it.
EXTRA_OF = {"httpx": "harness", "rich": "harness", "matplotlib": "harness", "numpy": "harness", "bcrypt": "auth"}


def missing_reason(module: str) -> str:
    extra = EXTRA_OF[module]
    return f"needs {module!r} from memtel's {extra!r} extra, which is not installed: pip install 'memtel[{extra}]'"


def missing_extra(error: BaseException | None) -> str | None:
    """The skip reason when `error` is the import of an optional extra's module that is not installed, else None."""
    if not isinstance(error, ModuleNotFoundError) or not error.name:
        return None
    module = error.name.split(".")[0]
    if module not in EXTRA_OF or importlib.util.find_spec(module) is not None:
        return None
    return missing_reason(module)


def need(module: str) -> ModuleType:
    """`module`, imported; the calling test skips with the extra to install where it is missing."""
    return pytest.importorskip(module, reason=missing_reason(module))


__all__ = ["EXTRA_OF", "missing_extra", "missing_reason", "need"]
