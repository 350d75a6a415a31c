"""The refusals live in the admission core (telemetry/admission/refusal.py); `ContextLength` reads an engine's
max-model-len for the front doors that fetch it on demand (the LiteLLM gate)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from telemetry.admission.refusal import (
    CONTEXT_LENGTH_EXCEEDED,
    DECIDE_BY_TOKENIZE_BYTES,
    EXCEEDS_MEMORY_AT_BEST,
    INVALID_REQUEST,
    MAX_MODELS_BYTES,
    MODELS_PATH,
    MODELS_REFRESH_S,
    RETRY_AFTER_S,
    SHOULD_RETRY,
    Refusal,
    behind,
    error_body,
    forecast_words,
    parse_models,
    permanent_from,
    refusal_for,
    uncountable,
    undecided,
)

MODELS_TIMEOUT_S = 2.0


@dataclass
class ContextLength:
    """The engine's max-model-len per model, from its /v1/models; None where it does not say."""

    by_model: dict[str, int] | None = None
    read_at: float | None = None  # monotonic
    _reading: asyncio.Task[None] | None = None  # one read at a time; refusals meanwhile wait for it

    async def get(self, fetch: Callable[[], Awaitable[tuple[int, bytes]]], model: object) -> int | None:
        """Max-model-len for `model` (any model of the upstream's when it names none or another: the least).

        fetch: one GET of the upstream's /v1/models, (status, body). A failed read keeps what was known.
        """
        if self._reading is None and (self.read_at is None or time.monotonic() - self.read_at > MODELS_REFRESH_S):
            self.read_at = time.monotonic()
            self._reading = asyncio.ensure_future(self._read(fetch))
        if self._reading is not None:
            reading = self._reading
            await asyncio.shield(reading)  # a client that goes away does not cancel the others' read
            if self._reading is reading:
                self._reading = None
        known = self.by_model or {}
        if isinstance(model, str) and model in known:
            return known[model]
        return min(known.values()) if known else None

    async def _read(self, fetch: Callable[[], Awaitable[tuple[int, bytes]]]) -> None:
        try:
            status, data = await asyncio.wait_for(fetch(), MODELS_TIMEOUT_S)
        except Exception:  # unknown max-model-len: the refusal is transient, never a failure of its own
            return
        if status == 200:
            self.by_model = parse_models(data)



__all__ = ["CONTEXT_LENGTH_EXCEEDED", "DECIDE_BY_TOKENIZE_BYTES", "EXCEEDS_MEMORY_AT_BEST", "INVALID_REQUEST",
           "MAX_MODELS_BYTES", "MODELS_PATH", "MODELS_REFRESH_S", "MODELS_TIMEOUT_S", "RETRY_AFTER_S", "SHOULD_RETRY",
           "ContextLength", "Refusal", "behind", "error_body", "forecast_words", "parse_models", "permanent_from",
           "refusal_for", "uncountable", "undecided"]
