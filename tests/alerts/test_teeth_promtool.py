"""Teeth for telemetry/alerts/promtool.py without promtool (issue 30, mutation testing): the input series a
timeline becomes, the queries of its test group, the rule copies the score evaluates, the batches, and the
parse of what promtool printed. Each is a pure function; the slow tests run the same through promtool."""

from __future__ import annotations

import re

import pytest
import yaml

from telemetry.alerts import promtool
from telemetry.alerts.promtool import (
    SENTINEL,
    AlertRecord,
    Evaluation,
    batches,
    input_series,
    rule_metric_names,
    unit_test,
    without_annotations,
)
from telemetry.alerts.promtool import test_group as group_of  # not a test of this file
from telemetry.alerts.timeline import Expectation, Outcome, Record, Timeline
from telemetry.errors import ConfigError, RunError
from telemetry.scrape import DAEMON_PORT

T0 = 1_764_547_200.0
HEADROOM = "memtel_node_unified_headroom_bytes"
STARTING = "memtel_engine_start_remaining_bytes"        # the hook's exporter serves it (source "engine")
DECIDED = "memtel_protect_last_decision_timestamp_seconds"  # the daemon's, a Unix time
AVAILABLE = "memtel_node_mem_available_bytes"
PROMPT = "vllm:prompt_tokens_total"                    # vLLM's own /metrics
WANTED = {HEADROOM, STARTING, DECIDED, AVAILABLE, PROMPT}


def timeline(records: list[tuple[float, dict[str, float]]], outcome: Outcome | None = None,
             name: str = "t") -> Timeline:
    return Timeline(name, outcome or Outcome("benign", node="spark-a"),
                    tuple(Record(T0 + dt, {k: float(v) for k, v in values.items()}) for dt, values in records))


def labels(job: str, **extra: str) -> str:
    pairs = {"instance": f"spark-a:{DAEMON_PORT}", "job": job, "node": "spark-a", **extra}
    return ", ".join(f'{k}="{v}"' for k, v in sorted(pairs.items()))


def test_a_timeline_becomes_series_on_a_1_s_grid_with_stale_markers():
    records = [
        (0, {HEADROOM: 3e10, f'{STARTING}{{engine="e1"}}': 1.5, "memtel_node_mem_total_bytes": 1e11,
             PROMPT: 7, DECIDED: T0 + 0.5}),
        (1.2, {HEADROOM: 2.5e10}),
        (1.4, {HEADROOM: 2e10, f'{STARTING}{{engine="e1"}}': 2}),   # the same second: the later record wins
        (3, {HEADROOM: float("nan"), f'{AVAILABLE}{{instance="other:1"}}': 5, "not a series key": 1}),
    ]
    series, last = input_series(timeline(records), WANTED)
    assert last == 3
    assert [s["series"] for s in series] == sorted(s["series"] for s in series)
    assert {s["series"]: s["values"] for s in series} == {
        f"up{{{labels('memtel-daemon')}}}": "1 1 _ 1 stale",
        f"{HEADROOM}{{{labels('memtel-daemon')}}}": "30000000000 20000000000 _ _ stale",
        f"{STARTING}{{{labels('memtel-hook', engine='e1')}}}": "1.5 2 _ stale stale",
        f"{PROMPT}{{{labels('memtel-vllm')}}}": "7 stale _ _ stale",
        f"{DECIDED}{{{labels('memtel-daemon')}}}": "0.5 stale _ _ stale",   # seconds on the test's clock
        f'{AVAILABLE}{{instance="other:1", job="memtel-daemon", node="spark-a"}}': "_ _ _ 5 stale",
    }


def test_label_values_are_escaped_back_as_the_recorder_wrote_them():
    key = f'{AVAILABLE}{{path="a\\"b\\\\c\\nd"}}'
    series, _ = input_series(timeline([(0, {key: 1}), (1, {key: float("inf")})]), WANTED)
    assert f'{AVAILABLE}{{instance="spark-a:{DAEMON_PORT}", job="memtel-daemon", node="spark-a", ' \
           f'path="a\\"b\\\\c\\nd"}}' in {s["series"]: s["values"] for s in series}
    assert [s["values"] for s in series if s["series"].startswith(AVAILABLE)] == ["1 _ stale"]


FIRING = 'ALERTS{alertstate="firing"}'


def query(name: str, expr: str, at: int) -> dict[str, object]:
    return {"expr": f'label_replace({expr}, "memtel_score_query", "{name}", "", "")', "eval_time": f"{at}s",
            "exp_samples": [{"labels": SENTINEL, "value": 0}]}


def test_the_test_group_asks_what_each_alert_did_and_when_it_first_fired_before_the_failure():
    failure = Outcome("failure", failure_at=T0 + 2.7, node="spark-a", expect=(Expectation("A"),))
    line = timeline([(0, {HEADROOM: 1}), (3, {HEADROOM: 2})], failure, name="crash")
    group = group_of(line, WANTED, 7)
    assert group == {
        "name": "crash", "interval": "1s", "external_labels": {"runbook_base": "runbook.md"},
        "input_series": input_series(line, WANTED)[0],
        "promql_expr_test": [
            query("q_first_7", f"min by (alertname) (min_over_time(timestamp({FIRING})[4s:1s]))", 3),
            query("q_last_7", f"max by (alertname) (max_over_time(timestamp({FIRING})[4s:1s]))", 3),
            query("q_seconds_7", f"sum by (alertname) (count_over_time({FIRING}[4s]))", 3),
            query("q_onsets_7", f"sum by (alertname) (sum_over_time(({FIRING} unless {FIRING} offset 1s)[4s:1s]))",
                  3),
            query("q_before_7", f"min by (alertname) (min_over_time(timestamp({FIRING})[3s:1s]))", 2),
        ]}


@pytest.mark.parametrize("failure_s, at", [(0, 0), (0.99, 0), (1.0, 1), (500, 3)])
def test_the_failure_query_is_at_the_failure_second_within_the_timeline(failure_s, at):
    line = timeline([(0, {HEADROOM: 1}), (3, {HEADROOM: 2})], Outcome("failure", failure_at=T0 + failure_s))
    (before,) = [q for q in group_of(line, WANTED)["promql_expr_test"] if "q_before_0" in str(q["expr"])]
    assert before["eval_time"] == f"{at}s" and f"[{at + 1}s:1s]" in str(before["expr"])


def test_a_benign_timeline_has_no_failure_query():
    queries = group_of(timeline([(0, {HEADROOM: 1})]), WANTED)["promql_expr_test"]
    assert [re.findall(r'"(q_[a-z]+_0)"', str(q["expr"])) for q in queries] == \
        [["q_first_0"], ["q_last_0"], ["q_seconds_0"], ["q_onsets_0"]]


def test_a_unit_test_file_has_one_group_per_timeline_indexed_by_its_place(tmp_path):
    rules = tmp_path / "r.yml"
    lines = [timeline([(0, {HEADROOM: 1})], name="a"), timeline([(0, {HEADROOM: 2})], name="b")]
    test = unit_test(lines, [rules], WANTED)
    assert test == {"rule_files": [str(rules.resolve())], "evaluation_interval": "1s",
                    "tests": [group_of(lines[0], WANTED, 0), group_of(lines[1], WANTED, 1)]}


RECORDING = """
groups:
  - name: levels
    rules:
      - record: a:used
        expr: b:used + memtel_x
      - record: c:unused
        expr: memtel_z
      - record: b:used
        expr: e:used * 2
      - record: e:used
        expr: memtel_y
  - name: dashboards-only
    rules:
      - record: d:unused
        expr: memtel_w
"""
ALERTS = """
groups:
  - name: alerts
    rules:
      - alert: A
        expr: a:used > 1
        for: 5s
        labels: {severity: critical}
        annotations: {summary: "{{ $value }} left"}
      - alert: B
        expr: memtel_q > 0
"""


def test_the_copies_keep_the_alerts_and_what_they_read_without_annotations(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    files = []
    for name, text in (("recording.yml", RECORDING), ("alerts.yml", ALERTS), ("empty.yml", "")):
        files.append(tmp_path / "in" / name)
        files[-1].write_text(text)
    copies = without_annotations(files, tmp_path / "out")
    assert copies == [tmp_path / "out" / "0-recording.yml", tmp_path / "out" / "1-alerts.yml",
                      tmp_path / "out" / "2-empty.yml"]
    recording, alerts, empty = (yaml.safe_load(p.read_text()) for p in copies)
    assert recording == {"groups": [{"name": "levels", "rules": [
        {"record": "a:used", "expr": "b:used + memtel_x"}, {"record": "b:used", "expr": "e:used * 2"},
        {"record": "e:used", "expr": "memtel_y"}]}]}
    assert alerts == {"groups": [{"name": "alerts", "rules": [
        {"alert": "A", "expr": "a:used > 1", "for": "5s", "labels": {"severity": "critical"}},
        {"alert": "B", "expr": "memtel_q > 0"}]}]}
    assert list(recording["groups"][0]["rules"][0]) == ["record", "expr"]  # the file's own order
    assert empty == {"groups": []}
    assert "annotations" in files[1].read_text()   # the originals are left as they were


def test_rule_metric_names_are_every_identifier_in_the_expressions(tmp_path):
    path = tmp_path / "r.yml"
    path.write_text(RECORDING + ALERTS.replace("groups:\n", ""))
    empty = tmp_path / "e.yml"
    empty.write_text("")
    names = rule_metric_names([path, empty])
    assert {"a:used", "b:used", "e:used", "memtel_x", "memtel_y", "memtel_z", "memtel_w"} <= names
    assert "d:unused" not in names and "c:unused" not in names   # written, not read
    assert rule_metric_names([empty]) == set()


def sized(*counts: int) -> list[Timeline]:
    return [timeline([(i, {HEADROOM: 1}) for i in range(n)], name=f"t{n}") for n in counts]


@pytest.mark.parametrize("counts, count, expected", [
    ((5, 1, 3, 2), 2, [[2, 3], [0, 1]]),   # longest first, each to the lightest batch
    ((5, 1, 3, 2), 1, [[0, 1, 2, 3]]),
    ((5, 1, 3, 2), 0, [[0, 1, 2, 3]]),
    ((2, 4), 8, [[1], [0]]),                # never more batches than timelines
    ((), 3, []),
])
def test_batches_balance_the_records(counts, count, expected):
    assert batches(sized(*counts), count) == expected


@pytest.mark.parametrize("query, value, field, expected", [
    ("q_first", 3.0, "first_fired_s", 3.0), ("q_last", 9.0, "last_fired_s", 9.0),
    ("q_seconds", 4.0, "firing_seconds", 4.0), ("q_onsets", 2.0, "onsets", 2),
    ("q_before", 1.0, "first_fired_before_failure_s", 1.0),
])
def test_each_query_fills_its_field(query, value, field, expected):
    evaluation = Evaluation(timeline([(0, {})]))
    promtool._record(evaluation, "A", query, value)
    assert vars(evaluation.alerts["A"]) == {**vars(AlertRecord()), field: expected}
    assert type(getattr(evaluation.alerts["A"], field)) is type(expected)


def test_without_promtool_the_error_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RunError, match=r"^promtool is not installed: install Debian's prometheus package \(or "
                                       r"Prometheus's release\), whose promtool runs the rules$"):
        promtool.promtool_path()


def test_a_missing_rule_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=f"^--rules {tmp_path / 'no.yml'}: no such file$"):
        promtool.check_rules([tmp_path / "no.yml"])


@pytest.mark.prometheus
def test_promtool_says_when_each_alert_fired(tmp_path):
    """The one real promtool run of this file (a tenth of a second): the queries of the test group, parsed back."""
    rules = tmp_path / "rules.yml"
    rules.write_text("groups:\n  - name: g\n    rules:\n"
                     f"      - alert: Low\n        expr: {HEADROOM} < 5\n"
                     f"      - alert: Never\n        expr: {HEADROOM} < 0\n")
    values = [10, 10, 3, 3, 10, 3, 10, 10, 10, 10]
    line = timeline([(i, {HEADROOM: v}) for i, v in enumerate(values)], Outcome("failure", failure_at=T0 + 6))
    assert promtool.evaluate(line, [rules]).alerts == {
        "Low": AlertRecord(first_fired_s=2, last_fired_s=5, firing_seconds=3, onsets=2, first_fired_before_failure_s=2)}


@pytest.mark.prometheus
def test_a_batch_promtool_cannot_evaluate_is_named(tmp_path):
    rules = tmp_path / "bad.yml"
    rules.write_text("groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: 'up =='\n")
    lines = [timeline([(0, {HEADROOM: 1})], name="a"), timeline([(0, {HEADROOM: 1})], name="b")]
    with pytest.raises(RunError, match=r"^a, b: promtool did not evaluate the timeline\(s\): "):
        promtool.evaluate_all(lines, [rules], {HEADROOM})
