"""Evaluate alert rules over a timeline with Prometheus's own rule engine: `promtool test rules`.

Each timeline becomes a promtool unit test group (a batch of them is one test file, one promtool process): its
records are the test's `input_series` on a 1 s grid (every rule group is evaluated every second, as the
memtel-headroom group is in production), and a few PromQL
queries over the `ALERTS` series that the rule manager writes ask, per alert, when it first and last fired,
how many seconds it fired, how often it started firing, and when it first fired before the failure. The
test's expected samples are a sentinel no query returns, so promtool prints what each query got; that
printout is the only thing parsed here. No rule is evaluated by memtel itself.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from telemetry.alerts.timeline import Timeline, parse_series_key
from telemetry.catalogue import sample_names
from telemetry.catalogue.vllm import VLLM_FAMILIES
from telemetry.errors import ConfigError, RunError
from telemetry.scrape import DAEMON_PORT

SENTINEL = "memtel_score_sentinel"
QUERY_LABEL = "memtel_score_query"
DAEMON_JOB = "memtel-daemon"
HOOK_JOB = "memtel-hook"
VLLM_JOB = "memtel-vllm"  # vLLM's own /metrics (configs/prometheus/prometheus.yml)
_HOOK_SOURCES = ("hook", "engine", "forecast")  # the catalogue's sources whose families the hook's exporter serves
_GOT = re.compile(r'\{alertname="([A-Za-z_][A-Za-z0-9_]*)", ' + QUERY_LABEL + r'="(q_[a-z]+)_(\d+)"\} ([^,\s]+)')
PROMTOOL_TIMEOUT_S = 300
_SERIES = sample_names()
_VLLM_SERIES = frozenset(name for entry in VLLM_FAMILIES.values() for name in entry.sample_names)


@dataclass
class AlertRecord:
    """What one alert did on one timeline (seconds from the timeline's first record)."""

    first_fired_s: float | None = None
    last_fired_s: float | None = None
    firing_seconds: float = 0.0
    onsets: int = 0
    first_fired_before_failure_s: float | None = None


@dataclass
class Evaluation:
    timeline: Timeline
    alerts: dict[str, AlertRecord] = field(default_factory=dict)


def promtool_path() -> str:
    path = shutil.which("promtool")
    if path is None:
        raise RunError("promtool is not installed: install Debian's prometheus package (or Prometheus's release), "
                       "whose promtool runs the rules")
    return path


def check_rules(rule_files: list[Path]) -> None:
    for path in rule_files:
        if not path.is_file():
            raise ConfigError(f"--rules {path}: no such file")
    result = subprocess.run([promtool_path(), "check", "rules", *map(str, rule_files)], capture_output=True,
                            text=True, timeout=120)
    if result.returncode != 0:
        detail = " ".join((result.stderr or result.stdout).split())[:300]
        raise ConfigError(f"--rules: promtool check rules failed: {detail}")


def rule_metric_names(rule_files: list[Path]) -> set[str]:
    """Every identifier in the rules' expressions: the series a timeline must carry for them (a superset)."""
    names: set[str] = set()
    for path in rule_files:
        data = yaml.safe_load(path.read_text()) or {}
        for group in data.get("groups", []):
            for rule in group.get("rules", []):
                names.update(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", str(rule.get("expr", ""))))
    return names


def _labels_text(labels: dict[str, str]) -> str:
    return ", ".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _value_text(value: float) -> str:
    if math.isnan(value) or math.isinf(value):
        return "_"
    return repr(value) if not value.is_integer() else str(int(value))


def _job(series: str) -> str:
    """The scrape job that serves `series` in the shipped Prometheus config: the hook's, vLLM's or the daemon's."""
    if series in _VLLM_SERIES:
        return VLLM_JOB
    entry = _SERIES.get(series)
    return HOOK_JOB if entry is not None and entry.source in _HOOK_SOURCES else DAEMON_JOB


def input_series(timeline: Timeline, wanted: set[str]) -> tuple[list[dict[str, str]], int]:
    """promtool input_series on a 1 s grid from the first record, and the last step; each series ends with a
    stale marker (after its last sample it is gone, as a target that stopped answering is), and a series that a
    record leaves out after having had a value is stale there (as a scrape that no longer carries it marks it:
    an engine whose start ended exports no memtel_engine_start_remaining_bytes)."""
    start = timeline.start
    steps: dict[int, dict[str, float]] = {}
    for record in timeline.records:
        steps[round(record.time - start)] = record.values  # two records in one second: the later wins
    last = max(steps)
    node = timeline.outcome.node
    series: dict[str, list[str]] = {}
    previous: set[str] = set()
    for step in range(last + 1):
        values = steps.get(step)
        if values is None:
            continue
        present: set[str] = set()
        up = f'up{{{_labels_text({"job": DAEMON_JOB, "instance": f"{node}:{DAEMON_PORT}", "node": node})}}}'
        series.setdefault(up, ["_"] * (last + 1))[step] = "1"
        for key, value in values.items():
            parsed = parse_series_key(key)
            if parsed is None or parsed[0] not in wanted:
                continue
            name, labels = parsed
            labels = {**labels, "job": _job(name), "instance": labels.get("instance", f"{node}:{DAEMON_PORT}"),
                      "node": node}
            if name.endswith("_timestamp_seconds"):
                value -= start  # a Unix time on the records' clock; the test's clock starts at 0
            key = f"{name}{{{_labels_text(labels)}}}"
            series.setdefault(key, ["_"] * (last + 1))[step] = _value_text(value)
            present.add(key)
        for gone in previous - present:
            series[gone][step] = "stale"
        previous = present
    out = [{"series": name, "values": " ".join([*tokens, "stale"])} for name, tokens in sorted(series.items())]
    return out, last


def _query(number: str, expr: str, at: int) -> dict[str, object]:
    return {"expr": f'label_replace({expr}, "{QUERY_LABEL}", "{number}", "", "")', "eval_time": f"{at}s",
            "exp_samples": [{"labels": SENTINEL, "value": 0}]}


def test_group(timeline: Timeline, wanted: set[str], index: int = 0) -> dict[str, object]:
    """One promtool test group: the timeline's input series and the queries over ALERTS, each query labelled
    with its name and `index` (the timeline's place in a batch)."""
    series, last = input_series(timeline, wanted)
    firing = 'ALERTS{alertstate="firing"}'
    window = f"{last + 1}s"
    queries = [
        _query(f"q_first_{index}", f"min by (alertname) (min_over_time(timestamp({firing})[{window}:1s]))", last),
        _query(f"q_last_{index}", f"max by (alertname) (max_over_time(timestamp({firing})[{window}:1s]))", last),
        _query(f"q_seconds_{index}", f"sum by (alertname) (count_over_time({firing}[{window}]))", last),
        _query(f"q_onsets_{index}",
               f"sum by (alertname) (sum_over_time(({firing} unless {firing} offset 1s)[{window}:1s]))", last),
    ]
    failure_at = timeline.outcome.failure_at
    if failure_at is not None:
        at = min(last, max(0, math.floor(failure_at - timeline.start)))
        queries.append(_query(f"q_before_{index}",
                              f"min by (alertname) (min_over_time(timestamp({firing})[{at + 1}s:1s]))", at))
    return {"name": timeline.name, "interval": "1s", "external_labels": {"runbook_base": "runbook.md"},
            "input_series": series, "promql_expr_test": queries}


def unit_test(timelines: list[Timeline], rule_files: list[Path], wanted: set[str]) -> dict[str, object]:
    """A promtool test file with one group per timeline (the queries of timeline i are labelled with i)."""
    return {"rule_files": [str(p.resolve()) for p in rule_files], "evaluation_interval": "1s",
            "tests": [test_group(timeline, wanted, i) for i, timeline in enumerate(timelines)]}


def _names(expr: object) -> set[str]:
    return set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", str(expr)))


def without_annotations(rule_files: list[Path], directory: Path) -> list[Path]:
    """Copies of the rule files as the score evaluates them: without annotations (they cannot change when an
    alert fires, and expanding their templates, some of which run a query, on every firing evaluation was most
    of promtool's time) and without the recording rules no alert reads, directly or through another recording
    rule (the dashboards' levels: promtool's time is about one evaluation per rule and second)."""
    loaded = [yaml.safe_load(path.read_text()) or {} for path in rule_files]
    rules = [rule for data in loaded for group in data.get("groups", []) for rule in group.get("rules", [])]
    needed: set[str] = set()
    for rule in rules:
        if "alert" in rule:
            needed |= _names(rule.get("expr", ""))
    records = {str(rule["record"]): _names(rule.get("expr", "")) for rule in rules if "record" in rule}
    while True:
        more = set().union(*(records[name] for name in needed & set(records))) - needed
        if not more:
            break
        needed |= more
    copies = []
    for i, (path, data) in enumerate(zip(rule_files, loaded, strict=True)):
        for group in data.get("groups", []):
            group["rules"] = [rule for rule in group.get("rules", [])
                              if "record" not in rule or rule["record"] in needed]
            for rule in group["rules"]:
                rule.pop("annotations", None)
        data["groups"] = [group for group in data.get("groups", []) if group["rules"]]
        copy = directory / f"{i}-{path.name}"
        copy.write_text(yaml.safe_dump(data, sort_keys=False))
        copies.append(copy)
    return copies


def batches(timelines: list[Timeline], count: int) -> list[list[int]]:
    """The timelines' indexes in `count` batches of about equal records (longest first, to the lightest)."""
    loads: list[tuple[int, list[int]]] = [(0, []) for _ in range(max(1, min(count, len(timelines))))]
    for i in sorted(range(len(timelines)), key=lambda i: -len(timelines[i].records)):
        load, members = min(loads, key=lambda item: item[0])
        loads.remove((load, members))
        loads.append((load + len(timelines[i].records), [*members, i]))
    return [sorted(members) for _, members in loads if members]


def evaluate_all(timelines: list[Timeline], rule_files: list[Path], wanted: set[str] | None = None,
                 workers: int = 1) -> list[Evaluation]:
    """Run promtool over the timelines, `workers` processes at once, each with one test file holding a batch of
    timelines (one promtool start and one parse of the rules per batch); what each alert did on each."""
    wanted = rule_metric_names(rule_files) if wanted is None else wanted
    evaluations = [Evaluation(timeline) for timeline in timelines]
    with tempfile.TemporaryDirectory(prefix="memtel-score-") as directory:
        copies = without_annotations(rule_files, Path(directory))

        def run(batch_number: int, members: list[int]) -> None:
            batch = [timelines[i] for i in members]
            path = Path(directory) / f"timelines_{batch_number}_test.yml"
            path.write_text(yaml.safe_dump(unit_test(batch, copies, wanted), sort_keys=False, width=1 << 30))
            names = ", ".join(t.name for t in batch)
            try:
                result = subprocess.run([promtool_path(), "test", "rules", str(path)], capture_output=True,
                                        text=True, timeout=PROMTOOL_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise RunError(f"{names}: promtool took more than {PROMTOOL_TIMEOUT_S} s") from None
            output = result.stdout + result.stderr
            if output.count("got:") < len(batch):
                detail = " ".join(output.split())[-300:]
                raise RunError(f"{names}: promtool did not evaluate the timeline(s): {detail}")
            for alert, query, number, value in _GOT.findall(output):
                _record(evaluations[members[int(number)]], alert, query, float(value))

        jobs = batches(timelines, workers)
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            for future in [pool.submit(run, n, members) for n, members in enumerate(jobs)]:
                future.result()
    return evaluations


def _record(evaluation: Evaluation, alert: str, query: str, number: float) -> None:
    record = evaluation.alerts.setdefault(alert, AlertRecord())
    if query == "q_first":
        record.first_fired_s = number
    elif query == "q_last":
        record.last_fired_s = number
    elif query == "q_seconds":
        record.firing_seconds = number
    elif query == "q_onsets":
        record.onsets = int(number)
    elif query == "q_before":
        record.first_fired_before_failure_s = number


def evaluate(timeline: Timeline, rule_files: list[Path], wanted: set[str] | None = None) -> Evaluation:
    """Run promtool over one timeline; what each alert did."""
    return evaluate_all([timeline], rule_files, wanted)[0]
