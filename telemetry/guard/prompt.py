"""The prompt's size lives in the admission core (telemetry/admission/prompt.py); these names stay here for the
front doors that import them from the guard."""

from telemetry.admission.prompt import (
    CHAT_COMPLETIONS,
    CHAT_MESSAGE_TOKENS,
    CHAT_TEMPLATE_TOKENS,
    COMPLETIONS,
    HOLD_COUNT_RATIO,
    HOLD_COUNT_SHARE,
    RESPONSES,
    SPECIAL_TOKENS_PER_PROMPT,
    PromptError,
    PromptSize,
    count_words,
    measure,
    parse_body,
)

__all__ = ["CHAT_COMPLETIONS", "CHAT_MESSAGE_TOKENS", "CHAT_TEMPLATE_TOKENS", "COMPLETIONS", "HOLD_COUNT_RATIO",
           "HOLD_COUNT_SHARE", "RESPONSES", "SPECIAL_TOKENS_PER_PROMPT", "PromptError", "PromptSize", "count_words",
           "measure", "parse_body"]
