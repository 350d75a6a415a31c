"""The /metrics body: the Prometheus text format (0.0.4) of a registry's families.

Byte for byte what `prometheus_client.generate_latest` writes (tests/exporter/test_exposition.py compares the
two on every registry memtel serves), in less time: a name's and a label name's check is done once per
family or per name instead of once per sample, no per-sample escaping scheme is chosen, and each label set's
written form and each value's are remembered between scrapes. A family this renderer does not write itself (a
name outside the classic character set, a sample with a timestamp or a native histogram) is rendered by
`generate_latest`, so the output never depends on which path wrote it. Why this is not `generate_latest`, and by
how much: docs/architecture.md ("The /metrics body").
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.utils import floatToGoString

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# OpenMetrics type -> the text format's TYPE, and the suffix the sample names carry
_TYPES = {"counter": ("counter", "_total"), "info": ("gauge", "_info"), "stateset": ("gauge", ""),
          "gaugehistogram": ("histogram", ""), "unknown": ("untyped", ""), "gauge": ("gauge", ""),
          "histogram": ("histogram", ""), "summary": ("summary", "")}
_OPENMETRICS_ONLY = ("_created", "_gsum", "_gcount")   # moved into gauges of their own, after the family


class _One:
    """A registry of one family, for `generate_latest`."""

    def __init__(self, metric: Any) -> None:
        self.metric = metric

    def collect(self) -> Iterable[Any]:
        return (self.metric,)


_MAX_REMEMBERED = 20000  # label sets (and values) remembered, a scrape's repeat; past it the memory starts again


class Renderer:
    """Renders registries; remembers which label names it has checked, each label set's written form (`name{k="v"} `)
    and each value's (`floatToGoString`): a scrape's names, label sets and most values are the last scrape's."""

    def __init__(self) -> None:
        self._labels_ok: dict[str, bool] = {}
        self._prefixes: dict[tuple[str, tuple[tuple[str, str], ...]], str | None] = {}
        self._values: dict[float, str] = {}

    def render(self, registry: Any) -> bytes:
        out: list[str] = []
        for metric in registry.collect():
            if not self._family(metric, out):
                out.append(generate_latest(_One(metric)).decode("utf-8"))
        return "".join(out).encode("utf-8")

    def _family(self, metric: Any, out: list[str]) -> bool:
        """Append the family's lines to `out`; False (nothing appended) where generate_latest must write it."""
        kind = _TYPES.get(metric.type)
        name = metric.name
        if kind is None or not _METRIC_NAME.fullmatch(name):
            return False
        text_type, suffix = kind
        shown = name + suffix
        if not _METRIC_NAME.fullmatch(shown):
            return False
        documentation = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
        lines = [f"# HELP {shown} {documentation}\n# TYPE {shown} {text_type}\n"]
        later: dict[str, list[str]] = {}
        checked: set[str] = set()
        prefixes, values = self._prefixes, self._values
        if len(prefixes) > _MAX_REMEMBERED:
            prefixes.clear()
        if len(values) > _MAX_REMEMBERED:
            values.clear()
        for sample in metric.samples:
            if sample.timestamp is not None or getattr(sample, "native_histogram", None) is not None:
                return False
            sample_name = sample.name
            if sample_name not in checked:
                if not _METRIC_NAME.fullmatch(sample_name):
                    return False
                checked.add(sample_name)
            value = sample.value
            text = values.get(value)
            if text is None:
                text = floatToGoString(value)
                if value and value == value:  # 0.0 and -0.0 are one key but two texts; NaN is no key
                    values[value] = text
            labels = sample.labels
            if labels:
                key = (sample_name, tuple(labels.items()))
                prefix = prefixes.get(key, "")
                if prefix == "":
                    prefix = prefixes[key] = self._prefix(sample_name, labels)
                if prefix is None:
                    return False
                line = f"{prefix}{text}\n"
            else:
                line = f"{sample_name} {text}\n"
            if sample_name in (shown, name):  # most samples: no OpenMetrics-only suffix to look for
                lines.append(line)
                continue
            for tail in _OPENMETRICS_ONLY:
                if sample_name == name + tail:
                    later.setdefault(tail, []).append(line)
                    break
            else:
                lines.append(line)
        for tail, tail_lines in sorted(later.items()):
            lines.append(f"# HELP {name}{tail} {documentation}\n# TYPE {name}{tail} gauge\n")
            lines.extend(tail_lines)
        out.extend(lines)
        return True

    def _prefix(self, sample_name: str, labels: dict[str, str]) -> str | None:
        """`name{k="v",...} ` with the labels sorted and escaped; None where a label name is outside the set."""
        labels_ok = self._labels_ok
        parts = []
        for key, value in sorted(labels.items()):
            ok = labels_ok.get(key)
            if ok is None:
                ok = labels_ok[key] = _LABEL_NAME.fullmatch(key) is not None
            if not ok:
                return None
            if "\\" in value or "\n" in value or '"' in value:
                value = value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
            parts.append(f'{key}="{value}"')
        return f"{sample_name}{{{','.join(parts)}}} "


__all__ = ["Renderer"]
