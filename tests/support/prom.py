"""Reading one value from a real /metrics endpoint in tests (standard library only: the gpu tests use it)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.support.http import get_text


def metric(url: str, name: str, labels: dict | None = None) -> float | None:
    """The sum of the samples named `name` whose labels include `labels`; None when there is none."""
    text = get_text(url, timeout=10)
    total = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                total = (total or 0.0) + sample.value
    return total
