"""The /metrics body: the Prometheus text format (0.0.4) of a registry's families.

Byte for byte what `prometheus_client.generate_latest` writes (tests/exporter/test_exposition.py compares the
two on every registry memtel serves), in less time: a name's and a label name's check is done once per
family or per name instead of once per sample, and no per-sample escaping scheme is chosen. A family this
renderer does not write itself (a name outside the classic character set, a sample with a timestamp or a
native histogram) is rendered by `generate_latest`, so the output never depends on which path wrote it.
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


class Renderer:
    """Renders registries; remembers which label names it has checked (a scrape's names repeat)."""

    def __init__(self) -> None:
        self._labels_ok: dict[str, bool] = {}

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
        labels_ok = self._labels_ok
        for sample in metric.samples:
            if sample.timestamp is not None or getattr(sample, "native_histogram", None) is not None:
                return False
            sample_name = sample.name
            if sample_name not in checked:
                if not _METRIC_NAME.fullmatch(sample_name):
                    return False
                checked.add(sample_name)
            labels = sample.labels
            if labels:
                parts = []
                for key, value in sorted(labels.items()):
                    ok = labels_ok.get(key)
                    if ok is None:
                        ok = labels_ok[key] = _LABEL_NAME.fullmatch(key) is not None
                    if not ok:
                        return False
                    if "\\" in value or "\n" in value or '"' in value:
                        value = value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
                    parts.append(f'{key}="{value}"')
                line = f"{sample_name}{{{','.join(parts)}}} {floatToGoString(sample.value)}\n"
            else:
                line = f"{sample_name} {floatToGoString(sample.value)}\n"
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


__all__ = ["Renderer"]
