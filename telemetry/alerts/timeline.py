"""A timeline: a node's series over time plus what happened in the end (docs/alerts.md, "Timelines").

A timeline file is JSON Lines (gzip-compressed when its name ends in .gz). Every line but one is a record, as
`memtel flight show --json` prints them:

    {"time": 1764626400.0, "values": {"memtel_node_unified_headroom_bytes": 3.1e10, ...}}

(other keys, such as `seq` and `boot_id`, are ignored). A record `{"time": ..., "up": 0, "values": {}}` is a
scrape of the node that failed (the host down or wedged: Prometheus writes `up` 0 and marks every series stale),
and so is every second of a gap of more than GAP_DOWN_S between two records (the flight recorder writes every
second while the daemon runs). Another target's `up` is a series with its job, `up{job="memtel-hook",...}`.
One line says what the timeline is:

    {"memtel_timeline": {"outcome": "failure", "failure_at": 1764626439.0, "onset_at": 1764626430.0,
                         "node": "spark-a", "description": "...",
                         "expect": [{"alert": "MemtelUnifiedHeadroomFalling", "within_s": 5,
                                     "severity": "critical"}]}}

`outcome` is "failure" (then `failure_at`, Unix seconds on the records' clock, is required) or "benign".
`expect` lists the alerts that claim to catch this failure: each must fire before `failure_at`, and within
`within_s` seconds of `onset_at` (or of the first record) when given; with `severity` ("critical": this must
page) the alert must carry that severity, and without `alert` any alert of that severity counts. So an incident
recorded by the flight recorder becomes a timeline by adding that one line to its export. Every problem is a
`ConfigError` that names the file and the line.

A timeline is data, never verdicts: a series the rule engine writes (`ALERTS`, `ALERTS_FOR_STATE`, any
recording rule's output: `rule_outputs`) is refused, or a file could say an alert fired that never did. It is
bounded before anything is evaluated: times are Unix seconds in [0, MAX_TIME_S], the records span at most
MAX_SPAN_S (promtool evaluates every second of it), at most MAX_RECORDS records and MAX_SERIES series, and
(seconds + 1) x (series + 1) at most MAX_WORK (promtool expands every series to every second of the span).
"""

from __future__ import annotations

import gzip
import io
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from telemetry.errors import ConfigError, shown
from telemetry.safeyaml import load_yaml_file

HEADER_KEY = "memtel_timeline"
OUTCOMES = ("benign", "failure")
HEADER_KEYS = ("outcome", "failure_at", "onset_at", "node", "description", "expect")
EXPECT_KEYS = ("alert", "within_s", "severity")
SEVERITIES = ("critical", "warning")
MAX_TIMELINE_BYTES = 256 * 1024 * 1024
MAX_RECORDS = 200_000  # two records a second over the longest span
MAX_SERIES_PER_RECORD = 10_000
MAX_SERIES = 10_000     # distinct series in one timeline (the shipped corpus: at most 99; a node exports ~100)
MAX_SPAN_S = 100_000.0  # the flight recorder's largest ring (100,000 slots) at its 1 s interval: 27.8 h
MAX_TIME_S = float(2**32)  # Unix seconds up to the year 2106
# promtool's work for one timeline, (seconds + 1) x (series + 1): it expands each series to every second of the
# span and evaluates the rules over it. BENCHMARKS.md ("Alerts: the score's work") has the cost per unit.
MAX_WORK = 8_000_000
GAP_DOWN_S = 10  # a gap between two records longer than this is failed scrapes of the node (up 0)
# Series only the rule engine writes: its alerts' state. Recording rules' outputs come from the rule files.
RULE_ENGINE_SERIES = frozenset({"ALERTS", "ALERTS_FOR_STATE"})
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,62}$")
_ALERT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# `name` or `name{a="x",b="y"}` as the flight recorder writes series keys (telemetry.flight.recorder.series_key).
_SERIES = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*)\})?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Expectation:
    alert: str | None   # None: any alert of `severity`
    within_s: float | None = None
    severity: str | None = None  # "critical": the failure must page

    @property
    def label(self) -> str:
        return self.alert or f"any {self.severity} alert"


@dataclass(frozen=True)
class Outcome:
    kind: str  # "benign" or "failure"
    failure_at: float | None = None
    onset_at: float | None = None
    node: str = "corpus-node"
    description: str = ""
    expect: tuple[Expectation, ...] = ()


@dataclass(frozen=True)
class Record:
    time: float
    values: dict[str, float]
    up: bool = True   # False: the node's scrape failed at this time


@dataclass(frozen=True)
class Timeline:
    name: str
    outcome: Outcome
    records: tuple[Record, ...]
    path: str = ""
    first_lines: Mapping[str, int] = field(default_factory=dict)  # metric name -> first line that carries it

    @property
    def start(self) -> float:
        return self.records[0].time

    @property
    def end(self) -> float:
        return self.records[-1].time

    @cached_property
    def series(self) -> int:
        return len({key for record in self.records for key in record.values})

    @cached_property
    def work(self) -> int:
        """promtool's work for it: (seconds + 1) x (series + 1, the daemon's `up`)."""
        return (round(self.end - self.start) + 1) * (self.series + 1)


def parse_series_key(key: str) -> tuple[str, dict[str, str]] | None:
    """(name, labels) of a flight recorder series key; None if it is not one."""
    match = _SERIES.match(key)
    if not match:
        return None
    labels = {k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
              for k, v in _LABEL.findall(match.group(2) or "")}
    return match.group(1), labels


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: expected a finite number, got {shown(value, 40)}")
    try:
        number = float(value)
    except OverflowError:   # an integer past a float's range
        number = math.inf
    if not math.isfinite(number):
        raise ConfigError(f"{where}: expected a finite number, got {shown(value, 40)}")
    return number


def _time(value: Any, where: str) -> float:
    number = _number(value, where)
    if not 0 <= number <= MAX_TIME_S:
        raise ConfigError(f"{where}: expected Unix seconds from 0 to {MAX_TIME_S:.0f} (the year 2106), "
                          f"got {shown(value, 40)}")
    return number


def _outcome(data: Any, where: str) -> Outcome:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {HEADER_KEY} must be an object with keys {', '.join(HEADER_KEYS)}")
    unknown = sorted(str(k)[:40] for k in data if k not in HEADER_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(HEADER_KEYS)}")
    kind = data.get("outcome")
    if kind not in OUTCOMES:
        raise ConfigError(f"{where}: outcome must be one of {', '.join(OUTCOMES)}, got {shown(kind, 40)}")
    failure_at = data.get("failure_at")
    if kind == "failure":
        if failure_at is None:
            raise ConfigError(f"{where}: a failure needs failure_at (Unix seconds on the records' clock)")
        failure_at = _time(failure_at, f"{where}: failure_at")
    elif failure_at is not None:
        raise ConfigError(f"{where}: a benign timeline has no failure_at")
    onset_at = data.get("onset_at")
    if onset_at is not None:
        onset_at = _time(onset_at, f"{where}: onset_at")
    node = data.get("node", "corpus-node")
    if not isinstance(node, str) or not _NODE.match(node):
        raise ConfigError(f"{where}: node must be a host name (letters, digits, . _ : -), got {shown(node, 40)}")
    description = data.get("description", "")
    if not isinstance(description, str) or len(description) > 2000:
        raise ConfigError(f"{where}: description must be text of at most 2000 characters")
    expect_raw = data.get("expect", [])
    if not isinstance(expect_raw, list) or len(expect_raw) > 64:
        raise ConfigError(f"{where}: expect must be a list of at most 64 {{alert, within_s}} objects")
    expect = []
    for i, item in enumerate(expect_raw):
        if not isinstance(item, dict) or set(item) - set(EXPECT_KEYS) or not ("alert" in item or "severity" in item):
            raise ConfigError(f"{where}: expect[{i}] must be an object with 'alert' or 'severity' (or both) and "
                              "optionally 'within_s'")
        if "alert" in item and (not isinstance(item["alert"], str) or not _ALERT.match(item["alert"])):
            raise ConfigError(f"{where}: expect[{i}].alert is not an alert name: {shown(item['alert'], 40)}")
        severity = item.get("severity")
        if severity is not None and severity not in SEVERITIES:
            raise ConfigError(f"{where}: expect[{i}].severity must be one of {', '.join(SEVERITIES)}, "
                              f"got {shown(severity, 40)}")
        within = item.get("within_s")
        if within is not None:
            within = _number(within, f"{where}: expect[{i}].within_s")
            if not 0 <= within <= MAX_SPAN_S:
                raise ConfigError(f"{where}: expect[{i}].within_s must be seconds from 0 to {MAX_SPAN_S:.0f}, "
                                  f"got {shown(within, 40)}")
        expect.append(Expectation(item.get("alert"), within, severity))
    if expect and kind != "failure":
        raise ConfigError(f"{where}: expect lists alerts that catch a failure; a benign timeline has none")
    return Outcome(kind, failure_at, onset_at, node, description, tuple(expect))


def _record(data: dict[str, object], where: str) -> Record:
    time = _time(data.get("time"), f"{where}: time")
    values = data.get("values")
    if not isinstance(values, dict) or len(values) > MAX_SERIES_PER_RECORD:
        raise ConfigError(f"{where}: values must be an object of at most {MAX_SERIES_PER_RECORD} series")
    up = data.get("up", 1)
    if up not in (0, 1) or isinstance(up, float):
        raise ConfigError(f"{where}: up must be 1 (the node's scrape answered) or 0 (it failed), got {shown(up, 40)}")
    if not up and values:
        raise ConfigError(f"{where}: a record with up 0 is a failed scrape and carries no values")
    parsed: dict[str, float] = {}
    for key, value in values.items():
        series = parse_series_key(key)
        if series is None:
            raise ConfigError(f"{where}: {shown(key)} is not a series name (name or name{{label=\"value\",...}})")
        if series[0] == "up" and not (series[1].get("job", "").startswith("memtel-")
                                      and not series[1]["job"].startswith("memtel-daemon")):
            raise ConfigError(f"{where}: {shown(key)}: an `up` series names its target's job (memtel-hook, "
                              "memtel-vllm, ...); the daemon's own is the record's up key")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: the value of {shown(key)} is not a number")
        try:
            parsed[key] = float(value)
        except OverflowError:
            raise ConfigError(f"{where}: the value of {shown(key)} is {shown(value, 40)}, past a float's range") \
                from None
    return Record(time, parsed, bool(up))


def _refused(name: str, where: str) -> ConfigError:
    return ConfigError(f"{where}: series {shown(name)} is written by the rule engine (an alert's state or a "
                       "recording rule's output): a timeline holds the rules' inputs only, never their verdicts")


def rule_outputs(rule_files: Iterable[Path]) -> frozenset[str]:
    """The series the rule engine writes with these rules: ALERTS, ALERTS_FOR_STATE and every recording rule's
    `record` name. A timeline carrying one is refused (refuse_rule_outputs)."""
    names = set(RULE_ENGINE_SERIES)
    for path in rule_files:
        data = load_yaml_file(path, "rule file")
        groups = data.get("groups") if isinstance(data, dict) else None
        for group in groups if isinstance(groups, list) else []:
            rules = group.get("rules") if isinstance(group, dict) else None
            for rule in rules if isinstance(rules, list) else []:
                if isinstance(rule, dict) and isinstance(rule.get("record"), str):
                    names.add(rule["record"])
    return frozenset(names)


def refuse_rule_outputs(timeline: Timeline, outputs: Iterable[str]) -> None:
    """ConfigError naming the file, the line and the series when `timeline` carries a series of `outputs`."""
    carried = sorted(set(outputs) & set(timeline.first_lines), key=lambda n: timeline.first_lines[n])
    if carried:
        raise _refused(carried[0], f"{timeline.path}:{timeline.first_lines[carried[0]]}")


def load_timeline(path: Path) -> Timeline:
    """Read and check one timeline file; ConfigError (one line naming the file and line) if it is not one."""
    try:
        size = path.stat().st_size
        if size > MAX_TIMELINE_BYTES:
            raise ConfigError(f"{path}: {size} bytes; a timeline file may hold at most {MAX_TIMELINE_BYTES}")
        raw = path.read_bytes()
        if path.name.endswith(".gz"):
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as unpacked:
                raw = unpacked.read(MAX_TIMELINE_BYTES + 1)
            if len(raw) > MAX_TIMELINE_BYTES:
                raise ConfigError(f"{path}: unpacks to more than {MAX_TIMELINE_BYTES} bytes")
    except (OSError, EOFError) as exc:
        raise ConfigError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; expected JSON Lines (memtel flight show --json)") from None
    outcome: Outcome | None = None
    records: list[Record] = []
    series: set[str] = set()
    first_lines: dict[str, int] = {}
    earliest, latest = math.inf, -math.inf
    for number, line in enumerate(text.splitlines(), 1):
        where = f"{path}:{number}"
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except (ValueError, RecursionError):   # not JSON; an integer past Python's digit limit
            raise ConfigError(f"{where}: not a JSON object; expected one record or the {HEADER_KEY} line") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: not a JSON object; expected one record or the {HEADER_KEY} line")
        if HEADER_KEY in data:
            if outcome is not None:
                raise ConfigError(f"{where}: a second {HEADER_KEY} line (a timeline has one outcome)")
            outcome = _outcome(data[HEADER_KEY], where)
            continue
        if len(records) >= MAX_RECORDS:
            raise ConfigError(f"{where}: more than {MAX_RECORDS:,} records (the most a timeline may hold)")
        record = _record(data, where)
        earliest, latest = min(earliest, record.time), max(latest, record.time)
        if latest - earliest > MAX_SPAN_S:
            raise ConfigError(f"{where}: the records span {latest - earliest:,.0f} s; a timeline may span at most "
                              f"{MAX_SPAN_S:,.0f} s (promtool evaluates every second of it)")
        for key in record.values:
            if key not in series:
                if len(series) >= MAX_SERIES:
                    raise ConfigError(f"{where}: more than {MAX_SERIES:,} series (the most a timeline may hold)")
                series.add(key)
                name = key.split("{", 1)[0]
                if name in RULE_ENGINE_SERIES:
                    raise _refused(name, where)
                first_lines.setdefault(name, number)
        records.append(record)
    if outcome is None:
        raise ConfigError(f"{path}: no {HEADER_KEY} line saying the outcome (benign, or failure with failure_at); "
                          "see docs/alerts.md")
    if not records:
        raise ConfigError(f"{path}: no records")
    records.sort(key=lambda r: r.time)
    if outcome.failure_at is not None and outcome.failure_at < records[0].time:
        raise ConfigError(f"{path}: failure_at {outcome.failure_at} is before the first record ({records[0].time})")
    name = path.name.removesuffix(".gz").removesuffix(".jsonl")
    timeline = Timeline(name, outcome, tuple(records), str(path), first_lines)
    if timeline.work > MAX_WORK:
        raise ConfigError(f"{path}: {timeline.end - timeline.start + 1:,.0f} s x {timeline.series + 1:,} series is "
                          f"{timeline.work:,} series-seconds; a timeline may hold at most {MAX_WORK:,} (promtool "
                          "expands every series to every second): split it, or keep the series the rules read")
    return timeline


def timeline_paths(corpus: Path) -> list[Path]:
    """The timeline files of a corpus: the file itself, or every *.jsonl and *.jsonl.gz in the directory."""
    if corpus.is_dir():
        paths = sorted([*corpus.glob("*.jsonl"), *corpus.glob("*.jsonl.gz")])
        if not paths:
            raise ConfigError(f"{corpus}: no *.jsonl or *.jsonl.gz timeline files in this directory")
        return paths
    if corpus.is_file():
        return [corpus]
    raise ConfigError(f"{corpus}: no such file or directory (expected a timeline .jsonl or a directory of them)")
