"""The serving engines memtel knows (vLLM, SGLang, the lab server): one module each, registered (registry.py).

Importing this package imports every module of its folder, so an engine is one file: `ENGINES` lists the
registered ones in order, `BY_NAME` finds one.
"""

from __future__ import annotations

import importlib
import pkgutil

from telemetry.engines.registry import Engine, registered


def _load() -> tuple[Engine, ...]:
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        importlib.import_module(f"{__name__}.{module}")
    return registered()


ENGINES: tuple[Engine, ...] = _load()
"""Every registered engine, in order."""
BY_NAME = {engine.name: engine for engine in ENGINES}

__all__ = ["BY_NAME", "ENGINES", "Engine"]
