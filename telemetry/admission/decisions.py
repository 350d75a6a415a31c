"""What the admission core decides for one prompt: each a value the front door performs.

- `Forward`: send the request to `replica`; `tokens` are held there until `Admission.release(forward, now)` (the
  first byte of the answer: the prefill is over). A replica that refuses the connection (nothing was sent):
  `Admission.unreachable(forward, why, now)`, then decide again.
- `Hold`: wait (the prompt is in the queue) until `Admission.wake(now)` names it or `deadline` (monotonic) passes,
  then decide again; a client that leaves: `Admission.leave(prompt, now)`. `refusal` is what it gets at the deadline.
- `CountFirst`: POST `body` to `replica`'s `/tokenize`, report `prompt.counted(count)` (its `count`) or
  `prompt.not_counted(refusal)` (no count: the upstream's answer, relayed if it matters), then decide again.
- `ReadModels`: GET `replica`'s `/v1/models`, report `Admission.models_read(replica, parse_models(body) or None, now)`,
  then decide again.
- `RefuseTransient` / `RefusePermanent`: answer `refusal` (status, OpenAI error body, `headers`): 503 with
  Retry-After and `x-should-retry: true`, or 400 (or the upstream's relayed status) that no retry can cure.
  `counted_as` is the reason to count it under (`memtel_guard_rejected`), None when it is not counted.

`Forward`, `RefuseTransient` and `RefusePermanent` end a prompt's stay in the queue: `queue_outcome` then says how
(admitted, refused, timed_out, queue_full) and `waited_s` how long it waited; both None for a prompt never queued.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from telemetry.admission.pool import Replica
    from telemetry.admission.refusal import Refusal


@dataclass(frozen=True)
class Forward:
    replica: Replica
    tokens: int  # held on the replica until released
    counted_by: str  # token_ids, byte_bound, tokenize, blind
    queue_outcome: str | None = None
    waited_s: float | None = None


@dataclass(frozen=True)
class Hold:
    refusal: Refusal  # the answer if it is still waiting at the deadline
    deadline: float  # monotonic

    @property
    def reason(self) -> str | None:
        return self.refusal.reason


@dataclass(frozen=True)
class CountFirst:
    replica: Replica
    body: dict[str, Any]  # the /tokenize request body


@dataclass(frozen=True)
class ReadModels:
    replica: Replica


@dataclass(frozen=True)
class _Refuse:
    refusal: Refusal
    counted_as: str | None
    queue_outcome: str | None = None
    waited_s: float | None = None

    @property
    def status(self) -> int:
        return self.refusal.status

    @property
    def reason(self) -> str | None:
        return self.refusal.reason

    @property
    def body(self) -> dict[str, Any]:
        return self.refusal.body

    @property
    def headers(self) -> tuple[tuple[str, str], ...]:
        return self.refusal.headers


@dataclass(frozen=True)
class RefuseTransient(_Refuse):
    """Waiting can cure it (503 with Retry-After, or the upstream's 5xx relayed)."""

    @property
    def retry_after(self) -> int | None:
        return self.refusal.retry_after


@dataclass(frozen=True)
class RefusePermanent(_Refuse):
    """No wait can cure it (400: over max-model-len or the at-best limit, uncountable; a 4xx relayed)."""


Refuse = RefuseTransient | RefusePermanent
Decision = Forward | Hold | CountFirst | ReadModels | RefuseTransient | RefusePermanent


def refuse(refusal: Refusal, counted_as: str | None, *, queue_outcome: str | None = None,
           waited_s: float | None = None) -> RefuseTransient | RefusePermanent:
    """The decision for `refusal`: transient where a retry may succeed (a 5xx, or one that says retry)."""
    kind = RefuseTransient if refusal.status >= 500 or refusal.should_retry else RefusePermanent
    return kind(refusal, counted_as, queue_outcome, waited_s)


__all__ = ["CountFirst", "Decision", "Forward", "Hold", "ReadModels", "Refuse", "RefusePermanent", "RefuseTransient",
           "refuse"]
