"""The OpenAI body a Serve request carries, and its prompt's size: what the router decides on.

Serve hands the router the call's arguments (`PendingRequest.args`, `.kwargs`), already resolved. A request to the
engine deployment carries the client's body as its first argument (a plain ingress passes the parsed JSON) or, in
Ray Serve LLM, as its `CompletionRequest` / `ChatCompletionRequest` model: dumped with only the fields the client
set, so the defaults vLLM's model fills in are not taken for fields a template may render. No Ray import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from telemetry.admission import PromptSize, measure
from telemetry.admission.prompt import CHAT_COMPLETIONS, COMPLETIONS

_PROMPT_FIELDS = ("prompt", "messages", "prompt_embeds")


def request_body(args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The OpenAI body of a call (its first argument, or `request=` / `body=`); None for any other call."""
    found: object = args[0] if args else kwargs.get("request", kwargs.get("body"))
    dump = getattr(found, "model_dump", None)
    if callable(dump):
        try:
            found = dump(exclude_unset=True)
        except Exception:  # a model that cannot be dumped is not a body the router can size
            return None
    if isinstance(found, Mapping) and any(key in found for key in _PROMPT_FIELDS):
        return dict(found)
    return None


def prompt_size(body: dict[str, Any]) -> PromptSize:
    """The prompt's bounds, as the guard sizes a chat or a completion request (PromptError: it cannot be sized)."""
    return measure(CHAT_COMPLETIONS if "messages" in body else COMPLETIONS, body)


__all__ = ["prompt_size", "request_body"]
