"""The gate's own metrics and blindness, shown by client.py's middleware (`GET /memtel/metrics`, the blind
header on `/health*`).

`GateMetrics` reads the gate when asked, on the proxy's event loop (the middleware serves the scrape there): per
deployment the gate has met whether it is blind, each hook's failed scrapes, the holds in the book, the refusals
by reason. Names, types and help texts are the catalogue's (telemetry/catalogue/metrics.py, "the LiteLLM gate");
docs/guard.md lists them. A deployment is met with the first request that names it: before that the gate has
no reading of it to be blind about.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from telemetry.admission.readings import MAX_PREFILL, NO_GAUGE_HINT
from telemetry.catalogue import metrics as catalogue
from telemetry.litellm.gate import Gate

FIXED_REASONS = ("would_not_fit", "in_prefill", "blind", "no_replica", "bad_request")  # exported even at 0


class GateCollector(Collector):
    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def describe(self) -> Iterator[Metric]:
        for family in (catalogue.LITELLM_DEPLOYMENT_BLIND, catalogue.LITELLM_HOOK_SCRAPE_FAILURES,
                       catalogue.LITELLM_HOLDS, catalogue.LITELLM_REFUSALS):
            yield family.new()

    def collect(self) -> Iterator[Metric]:
        trackers = self.gate.trackers()
        blind = catalogue.LITELLM_DEPLOYMENT_BLIND.new()
        failures = catalogue.LITELLM_HOOK_SCRAPE_FAILURES.new()
        for name, tracker in sorted(trackers.items()):
            blind.add_metric([name], float(tracker.limit() is None))
            for hook in tracker.hooks:
                failures.add_metric([hook.target.url], hook.failures)
        yield blind
        yield failures
        yield catalogue.LITELLM_HOLDS.new(len(self.gate.held))
        refusals = catalogue.LITELLM_REFUSALS.new()
        for reason, count in sorted({**dict.fromkeys(FIXED_REASONS, 0), **self.gate.refusals}.items()):
            refusals.add_metric([reason], count)
        yield refusals


class GateMetrics:
    """The gate as client.py's middleware shows it (client.GateView)."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(GateCollector(gate))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def blind(self) -> str | None:
        """Why the first blind deployment is blind (and how many are), or None while none is."""
        found = []
        for name, tracker in sorted(self.gate.trackers().items()):
            hooks = tracker.without_gauge()
            if hooks:
                found.append(f"deployment {name}: {len(hooks)} hook(s) export no {MAX_PREFILL}, e.g. {hooks[0]}: "
                             f"{NO_GAUGE_HINT}")
            elif tracker.limit() is None:
                found.append(f"deployment {name}: {tracker.why_blind()}")
        if not found:
            return None
        return found[0] if len(found) == 1 else f"{len(found)} deployments blind; {found[0]}"


__all__ = ["FIXED_REASONS", "GateCollector", "GateMetrics"]
