"""The refusals live in the admission core (telemetry/admission/refusal.py); these names stay here for the callers
that import them from the guard."""

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

__all__ = ["CONTEXT_LENGTH_EXCEEDED", "DECIDE_BY_TOKENIZE_BYTES", "EXCEEDS_MEMORY_AT_BEST", "INVALID_REQUEST",
           "MAX_MODELS_BYTES", "MODELS_PATH", "MODELS_REFRESH_S", "RETRY_AFTER_S", "SHOULD_RETRY", "Refusal", "behind",
           "error_body", "forecast_words", "parse_models", "permanent_from", "refusal_for", "uncountable", "undecided"]
