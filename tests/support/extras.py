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

# The top-level module -> the extra of pyproject.toml that installs it. `openai` is the tests' independent client
# (the `test` extra): a GPU box with the core install skips the modules that import it.
EXTRA_OF = {"httpx": "harness", "rich": "harness", "matplotlib": "harness", "numpy": "harness", "bcrypt": "auth",
            "openai": "test"}


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
    """`module`, imported; the calling test skips with the extra to install where it is missing. At a module's
    top (`openai = need("openai")`) it skips the whole module, as tests/conftest.py does for a plain import."""
    return pytest.importorskip(module, reason=missing_reason(module))


# A sitecustomize.py that makes the extras' modules unimportable in a Python started with its directory on
# PYTHONPATH, as on a box with memtel's core install only (tests/test_extras.py): a None in sys.modules makes
# `import openai` raise ModuleNotFoundError and importlib.util.find_spec("openai") answer None.
BLOCK_EXTRAS_SITECUSTOMIZE = f"""\
import sys

sys.modules.update(dict.fromkeys({sorted(EXTRA_OF)!r}))
"""


__all__ = ["BLOCK_EXTRAS_SITECUSTOMIZE", "EXTRA_OF", "missing_extra", "missing_reason", "need"]
