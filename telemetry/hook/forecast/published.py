"""What the live forecast tells `/snapshot`: the inputs of its last fit (runner.py `ForecastResults.tune_inputs`),
so that `memtel tune --hook` answers today's setting as the gauge does. One provider per process, set when the
forecast starts; the exporter calls it on its own thread when /snapshot is asked."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
_provider: Callable[[], dict[str, Any] | None] | None = None


def publish(provider: Callable[[], dict[str, Any] | None] | None) -> None:
    """Serve `provider()` with /snapshot from now on (None: nothing)."""
    global _provider
    with _lock:
        _provider = provider


def published() -> dict[str, Any] | None:
    """The forecast's inputs now, or None (no forecast, no fit yet, or its provider failed)."""
    provider = _provider
    if provider is None:
        return None
    try:
        return provider()
    except Exception:   # the forecast's state must never take /snapshot down
        return None


__all__ = ["publish", "published"]
