"""The one replica pool every front door shares: the replicas, their health, their max-model-len, and the choice.

A replica is in the pool while it is healthy (its last /health answered 200, and it did not refuse a connection
since) and its readings give a limit. A prompt goes to the replica in the pool with the most room (ties in turn);
with none in the pool but some healthy, to the first healthy one (blind: --when-blind decides); with none healthy,
nowhere (a transient refusal: it may wait). A replica that refuses the connection leaves the pool at once (`leave`)
and the prompt is decided again among the others; a /health answered 200 brings it back (`back`). One replica alone
is always chosen (its own answers say what is wrong with it).
"""

from __future__ import annotations

from collections.abc import Sequence

from telemetry.admission.readings import Readings
from telemetry.admission.refusal import MODELS_REFRESH_S


class MaxModelLen:
    """The engine's max-model-len per model, from its /v1/models (read by the caller when `stale`), None where it
    does not say. A failed read keeps what was known."""

    def __init__(self, refresh_s: float = MODELS_REFRESH_S) -> None:
        self.by_model: dict[str, int] | None = None
        self.read_at: float | None = None  # monotonic
        self.refresh_s = refresh_s

    def stale(self, now: float) -> bool:
        return self.read_at is None or now - self.read_at > self.refresh_s

    def record(self, by_model: dict[str, int] | None, now: float) -> None:
        self.read_at = now
        if by_model is not None:
            self.by_model = by_model

    def get(self, model: object) -> int | None:
        """Max-model-len for `model` (any model of the upstream's when it names none or another: the least)."""
        known = self.by_model or {}
        if isinstance(model, str) and model in known:
            return known[model]
        return min(known.values()) if known else None


class Replica:
    """One engine behind a front door: its name (its base URL), its readings, its health, its max-model-len."""

    def __init__(self, name: str, readings: Readings) -> None:
        self.name = name
        self.readings = readings
        self.models = MaxModelLen()
        self.healthy = True
        self.health_error: str | None = None


class ReplicaPool:
    def __init__(self, replicas: Sequence[Replica]) -> None:
        if not replicas:
            raise ValueError("a pool needs at least one replica")
        self.replicas = list(replicas)
        self._turn = 0  # breaks ties between replicas with the same room, in turn

    def choose(self, now: float, wall: float) -> Replica | None:
        """The replica a prompt goes to (see the module), None when none is healthy."""
        if len(self.replicas) == 1:
            return self.replicas[0]
        healthy = [r for r in self.replicas if r.healthy]
        if not healthy:
            return None
        sized = [(limit.tokens, r) for r in healthy if (limit := r.readings.limit_at(now, wall)) is not None]
        if not sized:
            return healthy[0]
        most = max(tokens for tokens, _r in sized)
        tied = [r for tokens, r in sized if tokens == most]
        self._turn += 1
        return tied[self._turn % len(tied)]

    def leave(self, replica: Replica, why: str) -> bool:
        """`replica` leaves the pool (it refused a connection or failed /health); whether it was in it."""
        was = replica.healthy
        replica.healthy, replica.health_error = False, why
        return was

    def back(self, replica: Replica) -> bool:
        """`replica` answered /health with 200: back in the pool; whether it had left."""
        was = not replica.healthy
        replica.healthy, replica.health_error = True, None
        return was

    def why_none(self) -> str:
        return "; ".join(f"{r.name}: {r.health_error}" for r in self.replicas)

    def why_blind(self, now: float, wall: float) -> str:
        if len(self.replicas) == 1:
            return self.replicas[0].readings.why_blind_at(now, wall)
        return "; ".join(f"{r.name}: {r.readings.why_blind_at(now, wall)}" for r in self.replicas)

    def rooms(self, now: float, wall: float) -> list[tuple[int, int]]:
        """(tokens it can take now, with nothing in prefill) for each replica in the pool."""
        return [(limit.tokens, limit.rank_tokens) for r in self.replicas
                if r.healthy and (limit := r.readings.limit_at(now, wall)) is not None]


__all__ = ["MaxModelLen", "Replica", "ReplicaPool"]
