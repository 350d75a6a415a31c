"""One catalogue of memtel's names: every exported metric family (metrics.py: name, type, labels, help, who
produces it) and the record fields (fields.py). Code builds families and reads records through these
entries instead of typing the names; tests/test_catalogue.py checks the docs, the rules, the dashboards
and the golden files against it. Adding a metric: docs/architecture.md, "Metric names".
"""

from __future__ import annotations

from prometheus_client.core import Metric

from telemetry.catalogue.family import COUNTER, GAUGE, HISTOGRAM, Family
from telemetry.catalogue.metrics import FAMILIES


def family(name: str) -> Family:
    """The entry of a family (`memtel_hook_calls`) or of its series (`memtel_hook_calls_total`); KeyError if none."""
    if name in FAMILIES:
        return FAMILIES[name]
    for entry in FAMILIES.values():
        if name in entry.sample_names:
            return entry
    raise KeyError(f"{name} is in no catalogue entry (telemetry/catalogue/metrics.py)")


def sample_names() -> dict[str, Family]:
    """Every sample name an entry can put on the wire, with its entry."""
    return {sample: entry for entry in FAMILIES.values() for sample in entry.sample_names}


def described(*sources: str) -> list[Metric]:
    """Every family these producers (`Family.source`) can export, without samples: a custom collector's
    `describe()`, so that registering it never collects and a registry refuses a second collector of one name."""
    return [entry.new() for entry in FAMILIES.values() if entry.source in sources]


__all__ = ["COUNTER", "FAMILIES", "GAUGE", "HISTOGRAM", "Family", "described", "family", "sample_names"]
