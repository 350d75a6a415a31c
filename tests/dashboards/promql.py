"""PromQL found in the memtel dashboards and rule files, and small text tools to check it live.

The checks in test_live_prometheus.py ask a real Prometheus whether each expression returns
series. Three helpers make that question meaningful:
- `substitute` replaces Grafana's variables (`$node`, `${site}`, `$__rate_interval`, ...).
- `boolify` turns every comparison into a `bool` comparison, so an alert condition that is false
  right now still returns its series (0/1) instead of nothing: "no series" then means a wrong
  metric or label name, not a quiet node.
- `selectors` lists the vector selectors (metric name plus matchers) and `grouping_labels` the
  labels of by/on/without/ignoring clauses, to check each name on its own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "dashboards" / "grafana").glob("*.json"))
RULE_FILES = [ROOT / "dashboards" / "prometheus" / "memtel-recording.yml",
              ROOT / "dashboards" / "prometheus" / "memtel-alerts.yml"]

# Metrics the dashboards and rules already use that no part of memtel exports yet, each with what will.
# Live, their queries are only checked to be valid PromQL; the documentation check leaves them out.
# test_pending_metrics_are_still_pending fails once one is documented: then remove it here, and every
# check applies to it.
PENDING_METRICS: dict[str, str] = {}

# Grafana's built-in interval variables, with values that suit a test Prometheus scraping every second.
BUILTIN_VALUES = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m"}


@dataclass(frozen=True)
class Query:
    where: str   # "dashboard.json: panel 'Title' (id 3) target A", "memtel-alerts.yml: alert X"
    expr: str


def reference_docs_text() -> str:
    """The docs that document metrics (every docs/*.md but the runbook, which only names them)."""
    return "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "runbook.md")


def load_dashboard(path: Path) -> dict:
    return json.loads(path.read_text())


def iter_panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # panels of a collapsed row


def dashboard_queries(path: Path) -> list[Query]:
    dashboard = load_dashboard(path)
    queries = []
    for panel in iter_panels(dashboard):
        for target in panel.get("targets", []):
            if target.get("expr"):
                queries.append(Query(f"{path.name}: panel {panel.get('title')!r} (id {panel.get('id')}) "
                                     f"target {target.get('refId')}", target["expr"]))
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if annotation.get("expr"):
            queries.append(Query(f"{path.name}: annotation {annotation.get('name')!r}", annotation["expr"]))
    return queries


def variable_queries(dashboard: dict) -> dict[str, str]:
    """name -> Grafana query text of each query variable (e.g. `label_values(metric{...}, node)`)."""
    out: dict[str, str] = {}
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable.get("query")
            out[variable["name"]] = str(query.get("query") if isinstance(query, dict) else query)
    return out


def load_rules() -> list[dict]:
    rules = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                rules.append(dict(rule, _file=path.name, _group=group["name"]))
    return rules


def rule_queries() -> list[Query]:
    return [Query(f"{r['_file']}: {'alert' if 'alert' in r else 'record'} {r.get('alert') or r.get('record')}",
                  r["expr"]) for r in load_rules()]


_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def substitute(expr: str, values: dict[str, str]) -> str:
    """Replace `$name` and `${name}` (and `${name:format}`) by values[name]; unknown names raise KeyError."""

    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name in values:
            return values[name]
        if name in BUILTIN_VALUES:
            return BUILTIN_VALUES[name]
        raise KeyError(f"variable ${name} has no value (known: {sorted(values) + sorted(BUILTIN_VALUES)})")

    return _VARIABLE.sub(replace, expr)


def variables_used(text: str) -> set[str]:
    return {m.group(1) or m.group(2) for m in _VARIABLE.finditer(text)}


def promql_regex_literal(value: str) -> str:
    """A label value as Grafana puts it into a `=~"..."` matcher: regex-escaped, then string-escaped."""
    return re.escape(value).replace("\\", "\\\\")


_COMPARISON = re.compile(r"==|!=|>=|<=|>|<")


def _outside_brackets(expr: str) -> Iterator[tuple[int, str]]:
    """Yield (index, char) of characters outside {...}, [...] and string literals."""
    depth_brace = depth_bracket = 0
    quote = None
    i = 0
    while i < len(expr):
        ch = expr[i]
        if quote:
            if ch == "\\":
                i += 2
                continue
            if ch == quote:
                quote = None
        elif ch in "\"'`":
            quote = ch
        elif ch == "{":
            depth_brace += 1
        elif ch == "}":
            depth_brace -= 1
        elif ch == "[":
            depth_bracket += 1
        elif ch == "]":
            depth_bracket -= 1
        elif depth_brace == 0 and depth_bracket == 0:
            yield i, ch
        i += 1


def boolify(expr: str) -> str:
    """Every comparison operator outside matchers becomes a `bool` comparison (already-bool ones stay)."""
    outside = {i for i, _ in _outside_brackets(expr)}
    out, i = [], 0
    while i < len(expr):
        match = _COMPARISON.match(expr, i) if i in outside else None
        if match:
            op = match.group(0)
            out.append(op)
            i = match.end()
            if not re.match(r"\s*bool\b", expr[i:]):
                out.append(" bool")
            continue
        out.append(expr[i])
        i += 1
    return "".join(out)


# Series names in memtel's rules and dashboards: memtel_* metrics, recording rules (`memtel:`,
# `instance:`, `rank:`, `site:`, `node:` levels), vLLM's own `vllm:` metrics, the daemon's `process_*`
# self-metrics and Prometheus' `up`.
VLLM_PREFIX = "vllm:"
_SELECTOR = re.compile(
    r"(?<![\w:\"'])((?:memtel_|memtel:|instance:|rank:|site:|node:|vllm:|process_)[\w:]*|up)\b\s*(\{[^}]*\})?")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_MATCHER = re.compile(r"([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*\"((?:[^\"\\]|\\.)*)\"")


def selectors(expr: str) -> list[str]:
    """Vector selectors (`name{matchers}`) in the expression, offsets and ranges left out, deduplicated."""
    seen: list[str] = []
    for match in _SELECTOR.finditer(expr):
        if expr[match.end():].lstrip().startswith("("):
            continue  # a function of that name, not a metric
        selector = match.group(1) + (match.group(2) or "")
        if selector not in seen:
            seen.append(selector)
    return seen


def matcher_labels(selector: str) -> set[str]:
    brace = selector.find("{")
    return set() if brace < 0 else {m.group(1) for m in _MATCHER.finditer(selector[brace:])}


def grouping_labels(expr: str) -> set[str]:
    labels = set()
    for match in _GROUPING.finditer(expr):
        labels |= {name.strip() for name in match.group(2).split(",") if name.strip()}
    return labels


def metric_name(selector: str) -> str:
    return selector.split("{", 1)[0]


def is_recording_rule(name: str) -> bool:
    """Recording rules have colons in their names; vLLM's metrics do too, under their own prefix."""
    return ":" in name and not name.startswith(VLLM_PREFIX)
