"""A timeline: a node's series over time plus what happened in the end (docs/alerts.md, "Timelines").

A timeline file is JSON Lines (gzip-compressed when its name ends in .gz). Every line but one is a record, as
`memtel flight show --json` prints them:

    {"time": 1764626400.0, "values": {"memtel_node_unified_headroom_bytes": 3.1e10, ...}}

(other keys, such as `seq` and `boot_id`, are ignored). One line says what the timeline is:

    {"memtel_timeline": {"outcome": "failure", "failure_at": 1764626439.0, "onset_at": 1764626430.0,
                         "node": "spark-a", "description": "...",
                         "expect": [{"alert": "MemtelUnifiedHeadroomFalling", "within_s": 5}]}}

`outcome` is "failure" (then `failure_at`, Unix seconds on the records' clock, is required) or "benign".
`expect` lists the alerts that claim to catch this failure: each must fire before `failure_at`, and within
`within_s` seconds of `onset_at` (or of the first record) when given. So an incident recorded by the flight
recorder becomes a timeline by adding that one line to its export. Every problem is a `ConfigError` that
names the file and the line.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from telemetry.errors import ConfigError

HEADER_KEY = "memtel_timeline"
OUTCOMES = ("benign", "failure")
HEADER_KEYS = ("outcome", "failure_at", "onset_at", "node", "description", "expect")
EXPECT_KEYS = ("alert", "within_s")
MAX_TIMELINE_BYTES = 256 * 1024 * 1024
MAX_RECORDS = 200_000  # 55 hours at one record a second
MAX_SERIES_PER_RECORD = 10_000
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,62}$")
_ALERT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# `name` or `name{a="x",b="y"}` as the flight recorder writes series keys (telemetry.flight.recorder.series_key).
_SERIES = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*)\})?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Expectation:
    alert: str
    within_s: float | None = None


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


@dataclass(frozen=True)
class Timeline:
    name: str
    outcome: Outcome
    records: tuple[Record, ...]

    @property
    def start(self) -> float:
        return self.records[0].time

    @property
    def end(self) -> float:
        return self.records[-1].time


def parse_series_key(key: str) -> tuple[str, dict[str, str]] | None:
    """(name, labels) of a flight recorder series key; None if it is not one."""
    match = _SERIES.match(key)
    if not match:
        return None
    labels = {k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
              for k, v in _LABEL.findall(match.group(2) or "")}
    return match.group(1), labels


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}: expected a finite number, got {str(value)[:40]!r}")
    return float(value)


def _outcome(data: Any, where: str) -> Outcome:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {HEADER_KEY} must be an object with keys {', '.join(HEADER_KEYS)}")
    unknown = sorted(str(k)[:40] for k in data if k not in HEADER_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(HEADER_KEYS)}")
    kind = data.get("outcome")
    if kind not in OUTCOMES:
        raise ConfigError(f"{where}: outcome must be one of {', '.join(OUTCOMES)}, got {str(kind)[:40]!r}")
    failure_at = data.get("failure_at")
    if kind == "failure":
        if failure_at is None:
            raise ConfigError(f"{where}: a failure needs failure_at (Unix seconds on the records' clock)")
        failure_at = _number(failure_at, f"{where}: failure_at")
    elif failure_at is not None:
        raise ConfigError(f"{where}: a benign timeline has no failure_at")
    onset_at = data.get("onset_at")
    if onset_at is not None:
        onset_at = _number(onset_at, f"{where}: onset_at")
    node = data.get("node", "corpus-node")
    if not isinstance(node, str) or not _NODE.match(node):
        raise ConfigError(f"{where}: node must be a host name (letters, digits, . _ : -), got {str(node)[:40]!r}")
    description = data.get("description", "")
    if not isinstance(description, str) or len(description) > 2000:
        raise ConfigError(f"{where}: description must be text of at most 2000 characters")
    expect_raw = data.get("expect", [])
    if not isinstance(expect_raw, list) or len(expect_raw) > 64:
        raise ConfigError(f"{where}: expect must be a list of at most 64 {{alert, within_s}} objects")
    expect = []
    for i, item in enumerate(expect_raw):
        if not isinstance(item, dict) or set(item) - set(EXPECT_KEYS) or "alert" not in item:
            raise ConfigError(f"{where}: expect[{i}] must be an object with 'alert' and optionally 'within_s'")
        if not isinstance(item["alert"], str) or not _ALERT.match(item["alert"]):
            raise ConfigError(f"{where}: expect[{i}].alert is not an alert name: {str(item['alert'])[:40]!r}")
        within = item.get("within_s")
        expect.append(Expectation(item["alert"], None if within is None else
                                  _number(within, f"{where}: expect[{i}].within_s")))
    if expect and kind != "failure":
        raise ConfigError(f"{where}: expect lists alerts that catch a failure; a benign timeline has none")
    return Outcome(kind, failure_at, onset_at, node, description, tuple(expect))


def _record(data: dict[str, object], where: str) -> Record:
    time = _number(data.get("time"), f"{where}: time")
    values = data.get("values")
    if not isinstance(values, dict) or len(values) > MAX_SERIES_PER_RECORD:
        raise ConfigError(f"{where}: values must be an object of at most {MAX_SERIES_PER_RECORD} series")
    parsed: dict[str, float] = {}
    for key, value in values.items():
        if parse_series_key(key) is None:
            raise ConfigError(f"{where}: {key[:80]!r} is not a series name (name or name{{label=\"value\",...}})")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: the value of {key[:80]} is not a number")
        parsed[key] = float(value)
    return Record(time, parsed)


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
    for number, line in enumerate(text.splitlines(), 1):
        where = f"{path}:{number}"
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            raise ConfigError(f"{where}: not a JSON object; expected one record or the {HEADER_KEY} line") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: not a JSON object; expected one record or the {HEADER_KEY} line")
        if HEADER_KEY in data:
            if outcome is not None:
                raise ConfigError(f"{where}: a second {HEADER_KEY} line (a timeline has one outcome)")
            outcome = _outcome(data[HEADER_KEY], where)
            continue
        if len(records) >= MAX_RECORDS:
            raise ConfigError(f"{where}: more than {MAX_RECORDS} records")
        records.append(_record(data, where))
    if outcome is None:
        raise ConfigError(f"{path}: no {HEADER_KEY} line saying the outcome (benign, or failure with failure_at); "
                          "see docs/alerts.md")
    if not records:
        raise ConfigError(f"{path}: no records")
    records.sort(key=lambda r: r.time)
    if outcome.failure_at is not None and outcome.failure_at < records[0].time:
        raise ConfigError(f"{path}: failure_at {outcome.failure_at} is before the first record ({records[0].time})")
    name = path.name.removesuffix(".gz").removesuffix(".jsonl")
    return Timeline(name, outcome, tuple(records))


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
