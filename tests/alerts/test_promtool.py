"""Teeth for telemetry/alerts/promtool.py without promtool (issue 30, mutation testing): the input series a
timeline becomes, the queries of its test group, the rule copies the score evaluates, the batches, and the
parse of what promtool printed. Each is a pure function; the slow tests run the same through promtool."""

from __future__ import annotations

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
        f"up{{{labels('memtel-daemon')}}}": "1+0x1 _ 1 stale",
        f"{HEADROOM}{{{labels('memtel-daemon')}}}": "30000000000 20000000000 _ _ stale",
        f"{STARTING}{{{labels('memtel-hook', engine='e1')}}}": "1.5 2 _ stale stale",
        f"{PROMPT}{{{labels('memtel-vllm')}}}": "7 stale _x2 stale",
        f"{DECIDED}{{{labels('memtel-daemon')}}}": "0.5 stale _x2 stale",   # seconds on the test's clock
        f'{AVAILABLE}{{instance="other:1", job="memtel-daemon", node="spark-a"}}': "_x3 5 stale",
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


def test_the_test_group_asks_what_each_alert_did_in_each_window(monkeypatch):
    monkeypatch.setattr(promtool, "WINDOW_S", 3)
    failure = Outcome("failure", failure_at=T0 + 2.7, node="spark-a", expect=(Expectation("A"),))
    line = timeline([(0, {HEADROOM: 1}), (4, {HEADROOM: 2})], failure, name="crash")
    group = group_of(line, WANTED, 7)
    expected = []
    for number, (end, window) in enumerate(((2, "2s500ms"), (4, "1s500ms"))):
        tag = f"7_{number}"
        expected += [
            query(f"q_first_{tag}", f"min by (alertname) (min_over_time(timestamp({FIRING})[{window}:1s]))", end),
            query(f"q_last_{tag}", f"max by (alertname) (max_over_time(timestamp({FIRING})[{window}:1s]))", end),
            query(f"q_seconds_{tag}", f"sum by (alertname) (count_over_time({FIRING}[{window}]))", end),
            query(f"q_onsets_{tag}",
                  f"sum by (alertname) (sum_over_time(({FIRING} unless {FIRING} offset 1s)[{window}:1s]))", end),
        ]
    assert group == {"name": "crash", "interval": "1s", "external_labels": {"runbook_base": "runbook.md"},
                     "input_series": input_series(line, WANTED)[0], "promql_expr_test": expected}


@pytest.mark.parametrize("last, size, expected", [
    (0, 300, [(0, 0)]), (299, 300, [(0, 299)]), (300, 300, [(0, 299), (300, 300)]),
    (7, 3, [(0, 2), (3, 5), (6, 7)]),
])
def test_the_windows_cover_every_second_once(monkeypatch, last, size, expected):
    monkeypatch.setattr(promtool, "WINDOW_S", size)
    assert promtool.windows(last) == expected


def test_a_failed_scrape_writes_up_0_and_marks_every_series_stale():
    hook_up = 'up{job="memtel-hook",instance="spark-a:9400"}'
    line = Timeline("t", Outcome("benign", node="spark-a"), (
        Record(T0, {HEADROOM: 5.0, hook_up: 1.0}), Record(T0 + 1, {}, up=False),
        Record(T0 + 2, {HEADROOM: 6.0, hook_up: 1.0}),
        Record(T0 + 3 + promtool.GAP_DOWN_S + 1, {HEADROOM: 7.0})))   # a gap: failed scrapes in between
    series, last = input_series(line, {HEADROOM, "up"})
    gap = promtool.GAP_DOWN_S + 1
    assert last == 3 + gap
    assert {s["series"]: s["values"] for s in series} == {
        f"up{{{labels('memtel-daemon')}}}": f"1 0 1 0+0x{gap - 1} 1 stale",
        f"{HEADROOM}{{{labels('memtel-daemon')}}}": f"5 stale 6 stale _x{gap - 1} 7 stale",
        'up{instance="spark-a:9400", job="memtel-hook", node="spark-a"}': f"1 0 1 0+0x{gap - 1} stale stale",
    }


def test_series_stay_sparse_however_long_the_span():
    """Issue 41: a dense 1 s grid per series made span x series the score's memory; runs are encoded."""
    line = timeline([(i, {HEADROOM: 1, AVAILABLE: i % 2}) for i in range(0, 50_000, 5)])
    series, last = input_series(line, WANTED)
    assert last == 49_995
    values = {s["series"].split("{")[0]: s["values"] for s in series}
    assert values[HEADROOM] == "1 _x4 " * 9_999 + "1 stale"
    assert len(values["up"]) < 80_000


@pytest.mark.parametrize("expr, expected", [
    ("rate(a_total[5m])", [({"a_total"}, 301)]),
    ('increase(b{x="1"}[15m]) > 0 or c', [({"b"}, 901)]),
    ("max_over_time(timestamp(up{agent!=''})[1h:15s])", [({"up", "agent"}, 241)]),
    ("d[8s] and e[1m30s]", [({"d"}, 9), ({"e"}, 91)]),
    ("vector(1)", []),
])
def test_each_range_of_a_rule_is_read_with_its_samples(expr, expected):
    assert promtool._selected(expr) == expected


def test_a_rule_that_would_pass_promtools_sample_limit_is_an_error():
    """A rule promtool's test engine stops never fires there: the score refuses the timeline rather than pass."""
    ranges = [("MemtelHookErrors", [({"memtel_hook_errors_total"}, 901)])]
    few = timeline([(0, {f'memtel_hook_errors_total{{stage="s{i}"}}': 0 for i in range(11)})])
    promtool.check_query_samples(few, ranges)   # 9,911 samples: within the limit
    many = timeline([(0, {f'memtel_hook_errors_total{{stage="s{i}"}}': 0 for i in range(12)})])
    with pytest.raises(RunError, match=r"^t: rule MemtelHookErrors could load 10,812 samples in one evaluation"):
        promtool.check_query_samples(many, ranges)


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


@pytest.mark.parametrize("costs, count, most, expected", [
    ((5, 1, 3, 2), 2, None, [[2, 3], [0, 1]]),   # largest first, each to the lightest batch
    ((5, 1, 3, 2), 1, None, [[0, 1, 2, 3]]),
    ((5, 1, 3, 2), 0, None, [[0, 1, 2, 3]]),
    ((2, 4), 8, None, [[1], [0]]),                # never more batches than parts
    ((), 3, None, []),
    ((5, 1, 3, 2), 1, 4, [[0], [2], [1, 3]]),     # no batch costs more than `most`, unless one part alone does
])
def test_batches_balance_the_cost(costs, count, most, expected):
    assert batches(list(costs), count, most) == expected


def test_a_long_timeline_is_cut_in_parts_each_with_the_rules_memory_before_it(monkeypatch):
    monkeypatch.setattr(promtool, "PART_S", 100)
    line = timeline([(i, {HEADROOM: 1}) for i in range(0, 251)])
    assert promtool.parts(line, 30) == [promtool.Part(0, 0, 99), promtool.Part(70, 100, 199),
                                        promtool.Part(170, 200, 250)]
    series, last = input_series(line, WANTED, promtool.Part(170, 200, 250))
    assert last == 80 and {s["series"].split("{")[0]: s["values"] for s in series}[HEADROOM] == "1+0x80 stale"
    queries = group_of(line, WANTED, 0, promtool.Part(170, 200, 250))["promql_expr_test"]
    assert {q["eval_time"] for q in queries} == {"80s"} and all("[50s500ms" in str(q["expr"]) for q in queries)


def test_the_rules_memory_is_their_longest_hold_range_and_offset(tmp_path):
    rules = tmp_path / "r.yml"
    rules.write_text("groups:\n  - name: g\n    rules:\n"
                     "      - alert: A\n        expr: rate(x[5m]) > 0 and y offset 15m\n        for: 10m\n"
                     "        keep_firing_for: 30s\n"
                     "      - alert: B\n        expr: max_over_time(timestamp(up)[1h:15s]) > 0\n        for: 1m\n")
    assert promtool.rule_memory_s([rules]) == 630 + 3600 + 900


def test_the_windows_answers_add_up():
    evaluation = Evaluation(timeline([(0, {})]))
    for kind, value in (("first", 3.0), ("last", 4.0), ("seconds", 2.0), ("onsets", 1.0),
                        ("first", 7.0), ("last", 9.0), ("seconds", 3.0), ("onsets", 1.0)):
        promtool._record(evaluation, "A", kind, value)
    assert evaluation.alerts["A"] == AlertRecord(first_fired_s=3.0, last_fired_s=9.0, firing_seconds=5.0, onsets=2)
    assert type(evaluation.alerts["A"].onsets) is int


def test_promtools_answers_and_errors_are_told_apart():
    too_many = "query processing would load too many samples into memory in query execution"
    query = 'expr: "label_replace(x, \\"memtel_score_query\\", \\"{}\\", \\"\\", \\"\\")", time: 5s,'
    output = "\n".join([
        "  FAILED:",
        "    " + query.format("q_first_0_1") + " err: " + too_many,
        "    " + query.format("q_last_0_1"),
        '        exp: {__name__="memtel_score_sentinel"} 0E+00',
        '        got: {alertname="A", memtel_score_query="q_last_0_1"} 4E+00, '
        '{alertname="B", memtel_score_query="q_last_0_1"} 5E+00',
        "    " + query.format("q_seconds_0_1"),
        '        exp: {__name__="memtel_score_sentinel"} 0E+00',
        "        got: nil"])
    answers, errors = promtool.parse_answers(output)
    assert answers == {"q_last_0_1": [("A", 4.0), ("B", 5.0)], "q_seconds_0_1": []}
    assert errors == {"q_first_0_1": too_many}


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
    with pytest.raises(RunError, match=r"^a: promtool failed the score's query for seconds 0 to 0: no answer: "):
        promtool.evaluate_all(lines, [rules], {HEADROOM})


@pytest.mark.slow
@pytest.mark.prometheus
def test_a_rule_promtool_stops_at_its_sample_limit_fails_the_score(tmp_path):
    """promtool reports a rule it could not evaluate (6,000 series on each side of `and`: 12,000 samples) and
    evaluates no further: the score names the rule instead of counting what did not fire."""
    rules = tmp_path / "rules.yml"
    rules.write_text("groups:\n  - name: g\n    rules:\n      - alert: A\n"
                     f"        expr: {AVAILABLE} > 0 and {AVAILABLE} > -1\n")
    line = timeline([(0, {f'{AVAILABLE}{{n="{i}"}}': 1 for i in range(6000)})], name="wide")
    with pytest.raises(RunError, match=r"^wide: promtool failed rule A at 0s: query processing would load too many "
                                       r"samples"):
        promtool.evaluate_all([line], [rules], {AVAILABLE})
