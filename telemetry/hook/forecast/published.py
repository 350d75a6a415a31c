"""What the live forecast tells `/snapshot`: the inputs of its last fit (runner.py `ForecastResults.tune_inputs`),
so that `memtel tune --hook` answers today's setting as the gauge does. One provider per process, set when the
forecast starts; the exporter calls it on its own thread when /snapshot is asked."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
_provider: Callable[[], dict[str, Any] | None] | None = None
_owner: object = None


def publish(provider: Callable[[], dict[str, Any] | None] | None, owner: object = None) -> None:
    """Serve `provider()` with /snapshot from now on (None: nothing); `owner` may withdraw it."""
    global _provider, _owner
    with _lock:
        _provider, _owner = provider, owner


def withdraw(owner: object) -> None:
    """Stop serving what `owner` published (a stopped forecast's last fit is no longer this process's)."""
    global _provider, _owner
    with _lock:
        if owner is not None and _owner is owner:
            _provider, _owner = None, None


def published() -> dict[str, Any] | None:
    """The forecast's inputs now, or None (no forecast, no fit yet, or its provider failed)."""
    provider = _provider
    if provider is None:
        return None
    try:
        return provider()
    except Exception:   # the forecast's state must never take /snapshot down
        return None


__all__ = ["publish", "published", "withdraw"]
