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

from telemetry.alerts.timeline import GAP_DOWN_S, Timeline, parse_series_key
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
_GOT = re.compile(r'\{alertname="([A-Za-z_][A-Za-z0-9_]*)", ' + QUERY_LABEL + r'="(q_[a-z]+_\d+_\d+)"\} ([^,\s]+)')
_QUERY_ID = re.compile(r'(q_[a-z]+_\d+_\d+)\\?"')
_WINDOW = re.compile(r"q_([a-z]+)_(\d+)_(\d+)")
_RULE_ERROR = re.compile(r"rule: ([A-Za-z_:][A-Za-z0-9_:]*), time: (\S+), err: (.*)")
_RANGE = re.compile(r"\[\s*((?:\d+(?:ms|[smhdwy]))+)\s*(?::\s*((?:\d+(?:ms|[smhdwy]))+)\s*)?\]")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
PROMTOOL_TIMEOUT_S = 300
MAX_QUERY_SAMPLES = 10_000  # promtool's test engine stops a query that would hold more (cmd/promtool/unittest.go)
WINDOW_S = 300              # the score's query windows: up to 33 alert series firing at once in one window
PART_S = 16_000             # a longer timeline is evaluated in parts of this many seconds (parts)
RULES_AS_SERIES = 250       # the rules' evaluation each second costs about as much as this many series (cost)
MAX_BATCH_COST = 10_000_000  # cost units in one promtool process: about 130 s here
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


def _encoded(events: list[tuple[int, str]], last: int) -> str:
    """A series' promtool values from its (step, token) events, run-length encoded (`v+0xN` for N+1 equal
    samples, `_xN` for N missing ones), then a stale marker past the last step: the text grows with the
    changes, not with the span."""
    out: list[str] = []
    step = 0
    i = 0
    while i < len(events):
        at, token = events[i]
        if at > step:
            out.append("_" if at - step == 1 else f"_x{at - step}")
        run = 1
        while (token != "stale" and i + run < len(events) and events[i + run][1] == token
               and events[i + run][0] == at + run):
            run += 1
        out.append(token if run == 1 else f"{token}+0x{run - 1}")
        step = at + run
        i += run
    if last + 1 > step:
        out.append("_" if last + 1 - step == 1 else f"_x{last + 1 - step}")
    out.append("stale")
    return " ".join(out)


def scrape_steps(timeline: Timeline) -> tuple[dict[int, dict[str, float] | None], int]:
    """The timeline's seconds that a scrape of the node answered (the record's values) or failed (None): a
    record with `up` false, and every second of a gap longer than GAP_DOWN_S between two records (the flight
    recorder writes every second while the daemon runs: a gap is a daemon or host that was down). Two records
    in one second: the later wins. And the last step."""
    start = timeline.start
    steps: dict[int, dict[str, float] | None] = {}
    previous: int | None = None
    for record in timeline.records:
        step = round(record.time - start)
        if previous is not None and step - previous > GAP_DOWN_S:
            for missed in range(previous + 1, step):
                steps[missed] = None
        steps[step] = record.values if record.up else None
        previous = step
    return steps, max(steps)


@dataclass(frozen=True)
class Part:
    """A span of a timeline that one promtool test group evaluates: its steps `base`..`end` (seconds from the
    timeline's first record), of which `begin`..`end` are scored; `base`..`begin` before them give the rules
    their history (rule_memory_s)."""

    base: int
    begin: int
    end: int


def rule_memory_s(rule_files: list[Path]) -> int:
    """How far back the rules can look, in seconds: the longest `for` plus `keep_firing_for`, the longest range
    and the longest offset of any rule, added up (an upper bound)."""
    longest = {"hold": 0.0, "range": 0.0, "offset": 0.0}
    for path in rule_files:
        data = yaml.safe_load(path.read_text()) or {}
        for group in data.get("groups", []):
            for rule in group.get("rules", []):
                expr = str(rule.get("expr", ""))
                hold = _seconds(str(rule.get("for", "0s"))) + _seconds(str(rule.get("keep_firing_for", "0s")))
                longest["hold"] = max(longest["hold"], hold)
                for match in _RANGE.finditer(expr):
                    longest["range"] = max(longest["range"], _seconds(match.group(1)))
                for offset in re.findall(r"offset\s+((?:\d+(?:ms|[smhdwy]))+)", expr):
                    longest["offset"] = max(longest["offset"], _seconds(offset))
    return math.ceil(sum(longest.values()))


def parts(timeline: Timeline, memory_s: int) -> list[Part]:
    """The timeline in parts of PART_S scored seconds, each with up to `memory_s` seconds before it: a long
    timeline is evaluated by several promtool processes, each within its time limit, and scored as a whole."""
    last = round(timeline.end - timeline.start)
    return [Part(max(0, begin - memory_s), begin, min(last, begin + PART_S - 1))
            for begin in range(0, last + 1, PART_S)]


def cost(timeline: Timeline, part: Part | None = None) -> int:
    """promtool's time for a part, in units of about 13 us here (BENCHMARKS.md, "Alerts: the score's work"):
    every series of every second, and the rules' evaluation every second (about as much as 250 series)."""
    seconds = round(timeline.end - timeline.start) + 1 if part is None else part.end - part.base + 1
    return seconds * (timeline.series + 1 + RULES_AS_SERIES)


def input_series(timeline: Timeline, wanted: set[str], part: Part | None = None) -> tuple[list[dict[str, str]], int]:
    """promtool input_series on a 1 s grid from the first record, and the last step; each series ends with a
    stale marker (after its last sample it is gone, as a target that stopped answering is), and a series that a
    record leaves out after having had a value is stale there (as a scrape that no longer carries it marks it:
    an engine whose start ended exports no memtel_engine_start_remaining_bytes). A failed scrape (scrape_steps)
    writes `up` 0 for the daemon and for every other target's `up` the timeline carries, and marks every other
    series stale, as Prometheus does. Series are kept sparse (events, run-length encoded): the work is the
    changes, not span x series. With `part`, its steps only, from its base (its base is the test's 0 s)."""
    steps, last = scrape_steps(timeline)
    if part is not None:
        steps = {step - part.base: values for step, values in steps.items() if part.base <= step <= part.end}
        last = part.end - part.base
    start = timeline.start + (part.base if part is not None else 0)
    node = timeline.outcome.node
    daemon_up = f'up{{{_labels_text({"job": DAEMON_JOB, "instance": f"{node}:{DAEMON_PORT}", "node": node})}}}'
    events: dict[str, list[tuple[int, str]]] = {daemon_up: []}
    targets: set[str] = set()      # the `up` series of other targets seen so far
    previous: set[str] = set()
    for step in sorted(steps):
        values = steps[step]
        present: set[str] = set()
        if values is None:
            events[daemon_up].append((step, "0"))
            for up in targets:
                events[up].append((step, "0"))
                present.add(up)
        else:
            events[daemon_up].append((step, "1"))
            for key, value in values.items():
                parsed = parse_series_key(key)
                if parsed is None or parsed[0] not in wanted:
                    continue
                name, labels = parsed
                job = labels["job"] if name == "up" and "job" in labels else _job(name)
                labels = {**labels, "job": job, "instance": labels.get("instance", f"{node}:{DAEMON_PORT}"),
                          "node": node}
                if name.endswith("_timestamp_seconds"):
                    value -= start  # a Unix time on the records' clock; the test's clock starts at 0
                key = f"{name}{{{_labels_text(labels)}}}"
                if name == "up":
                    targets.add(key)
                events.setdefault(key, []).append((step, _value_text(value)))
                present.add(key)
        for gone in previous - present:
            events[gone].append((step, "stale"))
        previous = present
    out = [{"series": name, "values": _encoded(tokens, last)} for name, tokens in sorted(events.items())]
    return out, last


def _query(number: str, expr: str, at: int) -> dict[str, object]:
    return {"expr": f'label_replace({expr}, "{QUERY_LABEL}", "{number}", "", "")', "eval_time": f"{at}s",
            "exp_samples": [{"labels": SENTINEL, "value": 0}]}


def windows(last: int, first: int = 0) -> list[tuple[int, int]]:
    """The score's query windows over steps first..last: (first step, last step), WINDOW_S seconds each."""
    return [(begin, min(last, begin + WINDOW_S - 1)) for begin in range(first, last + 1, WINDOW_S)]


def test_group(timeline: Timeline, wanted: set[str], index: int = 0, part: Part | None = None) -> dict[str, object]:
    """One promtool test group: the timeline's input series and, per window of WINDOW_S seconds, the queries
    over ALERTS (each window's own seconds only, so the windows add up), each labelled with its name, `index`
    (the timeline's place in a batch) and the window's number. A window keeps each query within promtool's
    limit of 10,000 samples (MAX_QUERY_SAMPLES) while fewer than MAX_QUERY_SAMPLES / WINDOW_S alert series fire
    at once; past it the query fails, and a failed query fails the score (evaluate_all). With `part`, the
    windows cover its scored steps (on the test's clock, which starts at its base)."""
    series, last = input_series(timeline, wanted, part)
    firing = 'ALERTS{alertstate="firing"}'
    queries = []
    first = 0 if part is None else part.begin - part.base
    for number, (begin, end) in enumerate(windows(last, first)):
        # A range of (end - begin) s + 500 ms at `end` holds the steps begin..end, whether the range's start is
        # inclusive (Prometheus 2) or not (Prometheus 3).
        window = f"{end - begin}s500ms"
        tag = f"{index}_{number}"
        queries += [
            _query(f"q_first_{tag}", f"min by (alertname) (min_over_time(timestamp({firing})[{window}:1s]))", end),
            _query(f"q_last_{tag}", f"max by (alertname) (max_over_time(timestamp({firing})[{window}:1s]))", end),
            _query(f"q_seconds_{tag}", f"sum by (alertname) (count_over_time({firing}[{window}]))", end),
            _query(f"q_onsets_{tag}",
                   f"sum by (alertname) (sum_over_time(({firing} unless {firing} offset 1s)[{window}:1s]))", end),
        ]
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


def _seconds(duration: str) -> float:
    return sum(float(n) * _UNIT_S[u] for n, u in re.findall(r"(\d+)(ms|[smhdwy])", duration))


def _selected(expr: str) -> list[tuple[set[str], float]]:
    """Each range of an expression (a range selector `name{...}[5m]` or a subquery `(...)[1h:15s]`): the names
    it reads and how many samples per series it loads on a 1 s grid (range / step + 1)."""
    out = []
    for match in _RANGE.finditer(expr):
        steps = _seconds(match.group(1)) / (_seconds(match.group(2)) if match.group(2) else 1.0) + 1
        head = expr[:match.start()].rstrip()
        if head.endswith("}"):
            head = head[:head.rfind("{")].rstrip()
        if head.endswith(")"):   # a subquery: every name inside its parentheses
            depth, i = 0, len(head) - 1
            while i >= 0:
                depth += {")": 1, "(": -1}.get(head[i], 0)
                if depth == 0:
                    break
                i -= 1
            out.append((set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", head[i:])), steps))
        else:
            name = re.search(r"([a-zA-Z_:][a-zA-Z0-9_:]*)$", head)
            if name:
                out.append(({name.group(1)}, steps))
    return out


def rule_ranges(rule_files: list[Path]) -> list[tuple[str, list[tuple[set[str], float]]]]:
    """(rule name, its ranges) for every rule that reads a range."""
    out = []
    for path in rule_files:
        data = yaml.safe_load(path.read_text()) or {}
        for group in data.get("groups", []):
            for rule in group.get("rules", []):
                ranges = _selected(str(rule.get("expr", "")))
                if ranges:
                    out.append((str(rule.get("alert") or rule.get("record")), ranges))
    return out


def check_query_samples(timeline: Timeline, ranges: list[tuple[str, list[tuple[set[str], float]]]]) -> None:
    """RunError when a rule's ranges could load more than promtool's MAX_QUERY_SAMPLES on this timeline: its
    test engine stops such a query, the rule manager only logs it, and the rule would never fire here (a score
    that passes without scoring). An upper bound: every series of a name counts, whatever the selector's
    labels."""
    counts: dict[str, int] = {}
    for key in {key for record in timeline.records for key in record.values}:
        name = key.split("{", 1)[0]
        counts[name] = counts.get(name, 0) + 1
    counts["up"] = counts.get("up", 0) + 1   # the daemon's, written by the score
    for rule, selected in ranges:
        samples = sum(steps * sum(counts.get(name, 0) for name in names) for names, steps in selected)
        if samples > MAX_QUERY_SAMPLES:
            raise RunError(f"{timeline.name}: rule {rule} could load {samples:,.0f} samples in one evaluation on "
                           f"this timeline's series; promtool's test engine stops a query at "
                           f"{MAX_QUERY_SAMPLES:,} and the rule could not fire: score it with fewer series")


def batches(costs: list[int], count: int, most: int | None = None) -> list[list[int]]:
    """Indexes into `costs` in batches of about equal cost (largest first, each to the lightest batch): `count`
    batches, more where a batch would cost more than `most` (a batch of one may cost more)."""
    if most is not None and most > 0:
        count = max(count, -(-sum(costs) // most))
    loads: list[tuple[int, list[int]]] = [(0, []) for _ in range(max(1, min(count, len(costs))))]
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        load, members = min(loads, key=lambda item: item[0])
        loads.remove((load, members))
        loads.append((load + costs[i], [*members, i]))
    return [sorted(members) for _, members in loads if members]


def parse_answers(output: str) -> tuple[dict[str, list[tuple[str, float]]], dict[str, str]]:
    """What promtool printed for each of our queries: {query id: [(alert, value)]} for those it answered (an
    empty list for `got: nil`), {query id: error} for those it failed."""
    answers: dict[str, list[tuple[str, float]]] = {}
    errors: dict[str, str] = {}
    current: str | None = None
    for line in output.splitlines():
        stripped = line.strip()
        if stripped.startswith("expr: "):
            match = _QUERY_ID.search(stripped)
            current = match.group(1) if match else None
            if current is not None and ", err: " in stripped:
                errors[current] = stripped.split(", err: ", 1)[1][:300]
                current = None
        elif stripped.startswith("got: ") and current is not None:
            answers[current] = [(alert, float(value)) for alert, query, value in _GOT.findall(stripped)
                                if query == current]
            current = None
    return answers, errors


def evaluate_all(timelines: list[Timeline], rule_files: list[Path], wanted: set[str] | None = None,
                 workers: int = 1) -> list[Evaluation]:
    """Run promtool over the timelines, `workers` processes at once, each with one test file holding a batch of
    timeline parts (one promtool start and one parse of the rules per batch, a batch costing at most
    MAX_BATCH_COST unless one part alone does); what each alert did on each timeline. Every query of every part
    must be answered: one that promtool failed (its sample limit, a bad expression) or left out is a RunError
    naming the timeline and the seconds it covers, never a zero."""
    wanted = rule_metric_names(rule_files) if wanted is None else wanted
    ranges = rule_ranges(rule_files)
    for timeline in timelines:
        check_query_samples(timeline, ranges)
    memory_s = rule_memory_s(rule_files)
    units = [(i, part) for i, timeline in enumerate(timelines) for part in parts(timeline, memory_s)]
    evaluations = [Evaluation(timeline) for timeline in timelines]
    with tempfile.TemporaryDirectory(prefix="memtel-score-") as directory:
        copies = without_annotations(rule_files, Path(directory))

        def run(batch_number: int, members: list[int]) -> list[tuple[int, str, str, float]]:
            batch = [units[m] for m in members]
            groups = [test_group(timelines[i], wanted, position, part) for position, (i, part) in enumerate(batch)]
            test = {"rule_files": [str(p.resolve()) for p in copies], "evaluation_interval": "1s", "tests": groups}
            path = Path(directory) / f"timelines_{batch_number}_test.yml"
            path.write_text(yaml.safe_dump(test, sort_keys=False, width=1 << 30))
            names = ", ".join(dict.fromkeys(timelines[i].name for i, _ in batch))
            try:
                result = subprocess.run([promtool_path(), "test", "rules", str(path)], capture_output=True,
                                        text=True, timeout=PROMTOOL_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise RunError(f"{names}: promtool took more than {PROMTOOL_TIMEOUT_S} s") from None
            output = result.stdout + result.stderr
            failed_rule = _RULE_ERROR.search(output)
            if failed_rule:   # promtool stops the test group at a rule it cannot evaluate
                raise RunError(f"{names}: promtool failed rule {failed_rule.group(1)} at {failed_rule.group(2)}: "
                               f"{failed_rule.group(3)[:300]}")
            answers, errors = parse_answers(output)
            got = []
            for position, (group, (i, part)) in enumerate(zip(groups, batch, strict=True)):
                queries = group["promql_expr_test"]
                assert isinstance(queries, list)
                spans = windows(part.end, part.begin)
                for query in queries:
                    ident = _QUERY_ID.search(str(query["expr"]))
                    assert ident is not None
                    qid = ident.group(1)
                    if qid in errors or qid not in answers:
                        window = _WINDOW.search(qid)
                        assert window is not None
                        begin, end = spans[int(window.group(3))]
                        why = errors.get(qid) or ("no answer: " + " ".join(output.split())[-300:])
                        raise RunError(f"{timelines[i].name}: promtool failed the score's query for seconds {begin} "
                                       f"to {end}: {why}")
                    kind = _WINDOW.search(qid)
                    assert kind is not None and int(kind.group(2)) == position
                    for alert, value in answers[qid]:
                        shift = part.base if kind.group(1) in ("first", "last") else 0
                        got.append((i, alert, kind.group(1), value + shift))
            return got

        jobs = batches([cost(timelines[i], part) for i, part in units], workers, MAX_BATCH_COST)
        with ThreadPoolExecutor(max_workers=min(len(jobs), max(1, workers))) as pool:
            for future in [pool.submit(run, n, members) for n, members in enumerate(jobs)]:
                for i, alert, kind, value in future.result():
                    _record(evaluations[i], alert, kind, value)
    for evaluation in evaluations:
        failure_at = evaluation.timeline.outcome.failure_at
        if failure_at is None:
            continue
        at = math.floor(failure_at - evaluation.timeline.start)
        for record in evaluation.alerts.values():
            if record.first_fired_s is not None and record.first_fired_s <= at:
                record.first_fired_before_failure_s = record.first_fired_s
    return evaluations


def _record(evaluation: Evaluation, alert: str, query: str, number: float) -> None:
    """Add one window's answer to what the alert did: the first firing is the earliest of the windows', the last
    the latest, seconds and onsets add up."""
    record = evaluation.alerts.setdefault(alert, AlertRecord())
    if query == "first":
        record.first_fired_s = number if record.first_fired_s is None else min(record.first_fired_s, number)
    elif query == "last":
        record.last_fired_s = number if record.last_fired_s is None else max(record.last_fired_s, number)
    elif query == "seconds":
        record.firing_seconds += number
    elif query == "onsets":
        record.onsets += int(number)


def evaluate(timeline: Timeline, rule_files: list[Path], wanted: set[str] | None = None) -> Evaluation:
    """Run promtool over one timeline; what each alert did."""
    return evaluate_all([timeline], rule_files, wanted)[0]
