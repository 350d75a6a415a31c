"""What a replica tells memtel's request router about itself: where its hooks and its engine are.

A Ray Serve replica says it through its routing stats: Serve's controller calls the deployment's
`record_routing_stats()` every `request_routing_stats_period_s` and hands the answer to the request router with
the replica (`RunningReplica.routing_stats`). A replica that returns `routing_stats([hook, ...], upstream=URL)`
there is found without anyone listing URLs: the router reads its ranks' hook exporters (`memtel_hooks`) and, for
a prompt only the engine can count, the engine's `/tokenize` (`memtel_upstream`). No Ray import: a plain
deployment, an `LLMServer` subclass and the tests call it alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

HOOKS_KEY = "memtel_hooks"
UPSTREAM_KEY = "memtel_upstream"


def routing_stats(hooks: Sequence[str], upstream: str | None = None) -> dict[str, Any]:
    """The routing stats that name this replica's hook exporters (every rank's) and its engine's base URL."""
    stats: dict[str, Any] = {HOOKS_KEY: [str(h) for h in hooks]}
    if upstream is not None:
        stats[UPSTREAM_KEY] = str(upstream)
    return stats


def hooks_of(stats: Mapping[str, Any] | None) -> tuple[str, ...] | None:
    """The hook URLs a replica's routing stats name; None where it names none, or not as a list of strings."""
    found = (stats or {}).get(HOOKS_KEY)
    if isinstance(found, str):
        found = found.split(",")
    if not isinstance(found, (list, tuple)) or not found or not all(isinstance(h, str) for h in found):
        return None
    return tuple(h.strip() for h in found if h.strip()) or None


def upstream_of(stats: Mapping[str, Any] | None) -> str | None:
    found = (stats or {}).get(UPSTREAM_KEY)
    return found.rstrip("/") if isinstance(found, str) and found else None


__all__ = ["HOOKS_KEY", "UPSTREAM_KEY", "hooks_of", "routing_stats", "upstream_of"]
