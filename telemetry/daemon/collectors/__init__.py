"""One collector per source, one module each. A module registers its collector with
`@telemetry.daemon.registry.register(NAME, ...)` on a `build(config)` function; importing this package
imports every module in this folder, so adding a collector is adding its file. Each collector takes its
paths (or library) as constructor arguments so tests can point it at fixture files; `build` wires the
daemon's config (`--proc-root`, the kmsg and processes sections)."""

from __future__ import annotations

import importlib
import pkgutil

from telemetry.daemon.registry import CollectorSpec, registered


def _load() -> tuple[CollectorSpec, ...]:
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        importlib.import_module(f"{__name__}.{module}")
    return registered()


SPECS: tuple[CollectorSpec, ...] = _load()
"""Every registered collector, in scrape order."""
NAMES = tuple(spec.name for spec in SPECS)
BY_NAME = {spec.name: spec for spec in SPECS}
