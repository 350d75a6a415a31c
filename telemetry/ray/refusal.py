"""A refusal of memtel's request router, and how an ingress answers it.

The router cannot answer HTTP: it ends a request by setting its routing future's exception, which Serve raises
in the caller of `handle.method.remote(...)`. `RouterRefusal` carries the admission core's answer (status, OpenAI
error body, retry headers) and a `status_code`, so Ray Serve LLM's ingress (which answers an exception with its
`status_code`) gives the client the same status: 400 for a prompt that can never fit (the OpenAI SDKs raise
`BadRequestError` at once), 503 with `Retry-After` for one that does not fit now. A plain ingress answers it in
full with `refusal_answer`.
"""

from __future__ import annotations

from typing import Any


class RouterRefusal(Exception):
    """The router's answer instead of a replica: HTTP status, OpenAI error body, headers."""

    def __init__(self, status: int, body: dict[str, Any], headers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(str(body.get("error", {}).get("message", "")))
        self.status_code = status
        self.body = body
        self.headers = headers

    def __reduce__(self) -> tuple[Any, ...]:  # crosses a process as itself (a handle in another actor)
        return (RouterRefusal, (self.status_code, self.body, self.headers))


def refusal_answer(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]] | None:
    """(status, body, headers) of the router's refusal in `exc` or its causes; None for any other error."""
    seen: BaseException | None = exc
    for _ in range(8):  # Ray may wrap it (a RayTaskError carries it as its cause)
        if seen is None:
            return None
        if isinstance(seen, RouterRefusal):
            return seen.status_code, seen.body, dict(seen.headers)
        seen = seen.__cause__
    return None


__all__ = ["RouterRefusal", "refusal_answer"]
