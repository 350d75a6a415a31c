"""One metric family of the catalogue: its name, type, labels and help, and the empty family a collector fills.

`Family.name` is the family's name as prometheus_client takes it (a counter without `_total`);
`Family.series` is the name a scrape, a rule or a dashboard sees (`..._total` for a counter), and
`Family.sample_names` every sample name the family can put on the wire (a histogram's `_bucket`,
`_sum`, `_count`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
# The families that can hold one unlabelled value (a histogram cannot).
_VALUED: dict[str, type[GaugeMetricFamily] | type[CounterMetricFamily]] = {
    GAUGE: GaugeMetricFamily, COUNTER: CounterMetricFamily}


@dataclass(frozen=True)
class Family:
    name: str
    type: str  # GAUGE, COUNTER or HISTOGRAM
    help: str
    labels: tuple[str, ...] = ()
    source: str = ""  # who produces it: a daemon collector's name, "hook", "forecast", "exporter", "lab", ...

    @property
    def series(self) -> str:
        return f"{self.name}_total" if self.type == COUNTER else self.name

    @property
    def sample_names(self) -> tuple[str, ...]:
        if self.type == HISTOGRAM:
            return tuple(f"{self.name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        return (self.series,)

    def new(self, value: float | None = None, *, labels: Sequence[str] | None = None) -> Metric:
        """An empty family (fill it with `add_metric`), or, with `value` and no labels, one unlabelled sample."""
        names = list(self.labels if labels is None else labels)
        if self.type == HISTOGRAM:
            if value is not None:
                raise ValueError(f"{self.name}: a histogram has no single value")
            return HistogramMetricFamily(self.name, self.help, labels=names)
        cls = _VALUED[self.type]
        if value is not None:
            return cls(self.name, self.help, value=value)
        return cls(self.name, self.help, labels=names)


class GaugeFamily(Family):
    def new(self, value: float | None = None, *, labels: Sequence[str] | None = None) -> GaugeMetricFamily:
        if value is not None:
            return GaugeMetricFamily(self.name, self.help, value=value)
        return GaugeMetricFamily(self.name, self.help, labels=list(self.labels if labels is None else labels))


class CounterFamily(Family):
    def new(self, value: float | None = None, *, labels: Sequence[str] | None = None) -> CounterMetricFamily:
        if value is not None:
            return CounterMetricFamily(self.name, self.help, value=value)
        return CounterMetricFamily(self.name, self.help, labels=list(self.labels if labels is None else labels))


class HistogramFamily(Family):
    def new(self, value: float | None = None, *, labels: Sequence[str] | None = None) -> HistogramMetricFamily:
        if value is not None:
            raise ValueError(f"{self.name}: a histogram has no single value")
        return HistogramMetricFamily(self.name, self.help, labels=list(self.labels if labels is None else labels))


def gauge(name: str, help: str, labels: Sequence[str] = (), *, source: str) -> GaugeFamily:
    return GaugeFamily(name, GAUGE, help, tuple(labels), source)


def counter(name: str, help: str, labels: Sequence[str] = (), *, source: str) -> CounterFamily:
    if name.endswith("_total"):
        raise ValueError(f"{name}: a counter family is named without _total (the exposition adds it)")
    return CounterFamily(name, COUNTER, help, tuple(labels), source)


def histogram(name: str, help: str, labels: Sequence[str] = (), *, source: str) -> HistogramFamily:
    return HistogramFamily(name, HISTOGRAM, help, tuple(labels), source)


__all__ = ["COUNTER", "GAUGE", "HISTOGRAM", "CounterFamily", "Family", "GaugeFamily", "HistogramFamily", "counter",
           "gauge", "histogram"]
