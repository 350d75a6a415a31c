"""memtel's own metrics read back: an exposition parsed with prometheus_client's parser, its series looked up by
catalogue entry (`exposition.first(metrics.MEM_AVAILABLE)`), never by a name typed again. A reader that names a
family through its entry follows a rename in the catalogue; tests/test_catalogue.py fails on a name typed
anywhere else.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from telemetry.catalogue import HISTOGRAM, Family
from telemetry.errors import printable

HISTOGRAM_PARTS = ("_bucket", "_sum", "_count")


class ExpositionError(ValueError):
    """The text is not the Prometheus text format; the message is one line saying why."""


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class Exposition:
    """The samples of one /metrics answer, in order, with lookups by catalogue entry."""

    samples: tuple[Sample, ...] = ()
    _by_name: dict[str, list[Sample]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for sample in self.samples:
            self._by_name.setdefault(sample.name, []).append(sample)

    def __bool__(self) -> bool:
        return bool(self.samples)

    def of(self, entry: Family, part: str | None = None, **labels: str) -> list[Sample]:
        """The samples of `entry` whose labels include `labels`; a histogram's by `part` (`_bucket`, `_sum`,
        `_count`)."""
        found = self._by_name.get(series_name(entry, part), [])
        if not labels:
            return list(found)
        return [s for s in found if all(s.labels.get(k) == v for k, v in labels.items())]

    def first(self, entry: Family, part: str | None = None, **labels: str) -> float | None:
        found = self.of(entry, part, **labels)
        return found[0].value if found else None

    def total(self, entry: Family, part: str | None = None, **labels: str) -> float | None:
        """The sum over the matching samples (None where there is none, never 0)."""
        found = self.of(entry, part, **labels)
        return sum(s.value for s in found) if found else None

    def largest(self, entry: Family, part: str | None = None, **labels: str) -> float | None:
        found = self.of(entry, part, **labels)
        return max(s.value for s in found) if found else None

    def labelled(self, name: str) -> str | None:
        """The first value of label `name` on any sample (a hook's `rank`, its `node`)."""
        return next((s.labels[name] for s in self.samples if name in s.labels), None)


def series_name(entry: Family, part: str | None = None) -> str:
    """The sample name of `entry` on the wire (a counter's `_total`; a histogram's `part`)."""
    if entry.type == HISTOGRAM:
        if part not in HISTOGRAM_PARTS:
            raise ValueError(f"{entry.name} is a histogram: name its part, one of {', '.join(HISTOGRAM_PARTS)}")
        return entry.name + part
    if part is not None:
        raise ValueError(f"{entry.name} is a {entry.type}: it has no {part} part")
    return entry.series


def parse(text: str, only: Iterable[Family] | None = None) -> Exposition:
    """The samples of exposition `text`; with `only`, just those of these entries (the other lines are not
    parsed: a guard reads four families out of a hook's hundreds of lines). ExpositionError for what is not
    the text format."""
    if only is not None:
        wanted = tuple(name for entry in only for name in entry.sample_names)
        text = "".join(line + "\n" for line in text.splitlines() if line.startswith(wanted))
    try:
        return Exposition(tuple(Sample(s.name, dict(s.labels), float(s.value))
                                for family in text_string_to_metric_families(text) for s in family.samples))
    except (ValueError, TypeError, IndexError, KeyError) as error:   # the parser's ways of saying "not metrics"
        raise ExpositionError(f"not the metrics text format ({printable(' '.join(str(error).split()), 80)})") \
            from None


def parse_body(body: bytes, only: Iterable[Family] | None = None) -> Exposition:
    """`parse` of a /metrics answer's body, which must be whole UTF-8 text."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise ExpositionError("body is not UTF-8 text: not a /metrics answer") from None
    if text and not text.endswith("\n"):   # the format ends every line, the last one too: this one was cut
        raise ExpositionError("body cut short (its last line has no end): not a whole /metrics answer")
    return parse(text, only)


__all__ = ["HISTOGRAM_PARTS", "Exposition", "ExpositionError", "Sample", "parse", "parse_body", "series_name"]
