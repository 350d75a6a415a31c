"""Teeth for telemetry/alerts/score.py without promtool (issue 30, mutation testing): what the score makes of
what each alert did on each timeline. The evaluations are built by hand here (promtool's part is tested by
the slow tests over the corpus and by test_teeth_promtool.py); the rules are a small file of this test."""

from __future__ import annotations

import json

import pytest

from telemetry.alerts import score as score_module
from telemetry.alerts.promtool import AlertRecord, Evaluation, rule_metric_names
from telemetry.alerts.score import ExpectationResult, as_dict, as_text, score
from telemetry.alerts.timeline import Expectation, Outcome, Record, Timeline

T0 = 1_764_547_200.0
RULES = """
groups:
  - name: levels
    rules:
      - record: r:level
        expr: memtel_node_unified_headroom_bytes / 2
  - name: alerts
    rules:
      - alert: Page
        expr: r:level < 1
        labels: {severity: critical}
      - alert: Warn
        expr: r:level < 2
        labels: {severity: warning}
      - alert: NoSeverity
        expr: r:level < 3
"""


def line(name: str, seconds: float, outcome: Outcome) -> Timeline:
    return Timeline(name, outcome, (Record(T0, {}), Record(T0 + seconds, {})))


QUIET = line("quiet", 120, Outcome("benign"))
CRASH = line("crash", 100, Outcome("failure", failure_at=T0 + 100, onset_at=T0 + 40, expect=(
    Expectation("Page", 30), Expectation("Warn"), Expectation("NoSeverity", 10))))
LATE = line("leak", 60, Outcome("failure", failure_at=T0 + 50, expect=(Expectation("Page", 5), Expectation("Warn"))))
WHAT_FIRED = {
    "quiet": {"Page": AlertRecord(1, 9, firing_seconds=3, onsets=2), "Warn": AlertRecord(),
              "Other": AlertRecord(4, 4, firing_seconds=1, onsets=1)},
    "crash": {"Page": AlertRecord(60, 99, 40, 1, first_fired_before_failure_s=60),
              "Warn": AlertRecord(100, 100, 1, 1, first_fired_before_failure_s=100)},
    "leak": {"Page": AlertRecord(10, 50, 41, 1, first_fired_before_failure_s=10),
             "Warn": AlertRecord(51, 51, 1, 1, first_fired_before_failure_s=51)},
}


@pytest.fixture
def scored(tmp_path, monkeypatch):
    rules = tmp_path / "rules.yml"
    rules.write_text(RULES)
    calls = []

    def evaluate_all(timelines, rule_files, wanted, workers):
        calls.append((rule_files, wanted, workers))
        return [Evaluation(t, dict(WHAT_FIRED[t.name])) for t in timelines]

    monkeypatch.setattr(score_module, "evaluate_all", evaluate_all)
    result = score([QUIET, CRASH, LATE], [rules])
    assert calls == [([rules], rule_metric_names([rules]), calls[0][2])] and calls[0][2] >= 1
    return result


def test_each_alert_is_scored_on_every_timeline(scored):
    assert {name: (s.severity, s.caught, s.missed, s.benign_fired) for name, s in scored.alerts.items()} == {
        "Page": ("critical", [("crash", 40), ("leak", 40)], [], [("quiet", 3, 2)]),
        "Warn": ("warning", [("crash", 0)], ["leak"], []),   # at the failure's second is in time; after it is not
        "NoSeverity": ("none", [], ["crash", "leak"], []),
        "Other": ("none", [], ["crash", "leak"], [("quiet", 1, 1)]),  # fired, though the rules do not name it
    }
    assert list(scored.alerts) == ["Page", "Warn", "NoSeverity", "Other"]


def test_expected_catches_are_in_time_late_or_missed(scored):
    assert scored.expectations == [
        ExpectationResult("crash", "Page", True, 40, 20, 30),
        ExpectationResult("crash", "Warn", True, 0, 60, None),
        ExpectationResult("crash", "NoSeverity", False, None, None, 10),
        ExpectationResult("leak", "Page", True, 40, 10, 5),   # no onset: from the first record
        ExpectationResult("leak", "Warn", False, None, None, None),   # it fired, but after the failure
    ]
    assert [r.ok for r in scored.expectations] == [True, True, False, False, False]
    assert scored.problems == [
        "Page (critical) pages on benign timeline quiet (2 time(s), 3 s firing)",
        "NoSeverity misses the failure of crash, which it is expected to catch",
        "Page caught leak 10 s after the onset; expected within 5 s",
        "Warn misses the failure of leak, which it is expected to catch",
    ]


@pytest.mark.parametrize("fired, detect_s, within_s, ok", [
    (True, 5.0, 5.0, True), (True, 5.5, 5.0, False), (True, None, 5.0, False), (True, None, None, True),
    (False, None, None, False), (False, 1.0, 5.0, False)])
def test_an_expectation_is_ok_when_it_fired_within_its_time(fired, detect_s, within_s, ok):
    assert ExpectationResult("t", "A", fired, 1.0, detect_s, within_s).ok is ok


def test_a_failure_that_must_page_is_not_caught_by_a_warning(tmp_path, monkeypatch):
    """Issue 38: the timeline says the failure must page (severity critical); a warning that fires is a problem,
    and without an alert named any critical alert counts."""
    rules = tmp_path / "rules.yml"
    rules.write_text(RULES)
    death = line("death", 100, Outcome("failure", failure_at=T0 + 100, onset_at=T0 + 40, expect=(
        Expectation("Warn", None, "critical"), Expectation(None, 30, "critical"), Expectation("Page", 10, "critical"))))
    monkeypatch.setattr(score_module, "evaluate_all", lambda timelines, *_a, **_k: [Evaluation(death, {
        "Warn": AlertRecord(41, 99, 58, 1, 41), "Page": AlertRecord(60, 99, 40, 1, 60)})])
    result = score([death], [rules])
    assert result.expectations == [
        ExpectationResult("death", "Warn", True, 59, 1, None, "critical", "warning"),
        ExpectationResult("death", "any critical alert", True, 40, 20, 30, "critical", None),
        ExpectationResult("death", "Page", True, 40, 20, 10, "critical", "critical"),
    ]
    assert result.problems == ["Warn is a warning alert; death must be caught by a critical one",
                               "Page caught death 20 s after the onset; expected within 10 s"]
    assert "  death: Warn fired 1 s after the onset, 59 s before the failure: a warning, NOT A PAGE" in \
        as_text(result).splitlines()


def test_a_warning_on_a_benign_timeline_is_no_problem(tmp_path, monkeypatch):
    rules = tmp_path / "rules.yml"
    rules.write_text(RULES)
    monkeypatch.setattr(score_module, "evaluate_all", lambda timelines, *_a, **_k: [
        Evaluation(QUIET, {"Warn": AlertRecord(1, 1, 5, 1), "Page": AlertRecord()})])
    result = score([QUIET], [rules])
    assert result.alerts["Warn"].benign_fired == [("quiet", 5, 1)] and result.alerts["Page"].benign_fired == []
    assert result.problems == []
    assert as_text(result).endswith("problems: none")


def test_the_json_says_everything_the_score_found(scored):
    data = json.loads(json.dumps(as_dict(scored)))
    assert data["rule_files"] == scored.rule_files and data["problems"] == scored.problems
    assert data["timelines"][0] == {
        "name": "quiet", "outcome": "benign", "node": "corpus-node", "seconds": 120, "records": 2,
        "failure_after_s": None,
        "alerts": {"Other": vars(AlertRecord(4, 4, 1, 1)), "Page": vars(AlertRecord(1, 9, 3, 2)),
                   "Warn": vars(AlertRecord())}}
    assert data["timelines"][1]["failure_after_s"] == 100 and data["timelines"][1]["outcome"] == "failure"
    assert data["alerts"]["Page"] == {
        "severity": "critical", "caught": [{"timeline": "crash", "lead_s": 40}, {"timeline": "leak", "lead_s": 40}],
        "missed": [], "benign_fired": [{"timeline": "quiet", "firing_s": 3, "onsets": 2}]}
    assert list(data["alerts"]) == sorted(data["alerts"])
    assert data["expectations"][0] == {"timeline": "crash", "alert": "Page", "fired_before_failure": True,
                                       "lead_s": 40, "detect_s": 20, "within_s": 30, "severity": None,
                                       "alert_severity": None, "ok": True}
    assert [e["ok"] for e in data["expectations"]] == [True, True, False, False, False]


def test_the_text_is_a_table_and_the_catches(scored):
    rules = scored.rule_files[0]
    assert as_text(scored).splitlines() == [
        f"rules: {rules}",
        "",
        "timelines: 2 failure (crash, leak), 1 benign (quiet)",
        "",
        "alert | severity | lead time before each failure caught | failures missed | benign timelines fired",
        "NoSeverity | none | - | 2/2 | -",
        "Other | none | - | 2/2 | quiet (1x, 1 s)",
        "Page | critical | crash 40 s, leak 40 s | 0/2 | quiet (2x, 3 s)",
        "Warn | warning | crash 0 s | 1/2 | -",
        "",
        "expected catches:",
        "  crash: Page fired 20 s after the onset, 40 s before the failure (expected within 30 s): ok",
        "  crash: Warn fired 60 s after the onset, 0 s before the failure: ok",
        "  crash: NoSeverity MISSED",
        "  leak: Page fired 10 s after the onset, 40 s before the failure (expected within 5 s): LATE",
        "  leak: Warn MISSED",
        "",
        "problems:",
        "  Page (critical) pages on benign timeline quiet (2 time(s), 3 s firing)",
        "  NoSeverity misses the failure of crash, which it is expected to catch",
        "  Page caught leak 10 s after the onset; expected within 5 s",
        "  Warn misses the failure of leak, which it is expected to catch",
    ]


def test_quiet_rules_say_what_they_watched(tmp_path, monkeypatch):
    rules = tmp_path / "rules.yml"
    rules.write_text(RULES)
    monkeypatch.setattr(score_module, "evaluate_all", lambda timelines, *_a, **_k: [
        Evaluation(t, {}) for t in timelines])
    text = as_text(score([QUIET, line("other", 30.4, Outcome("benign"))], [rules]))
    assert text.splitlines()[2:5] == ["timelines: 0 failure (-), 2 benign (quiet, other)", "",
                                      "watched 3 alerts over 150 s of timeline: none fired"]
    assert as_text(score([CRASH], [rules])).splitlines()[2] == "timelines: 1 failure (crash), 0 benign (-)"


def test_quiet_alerts_beside_shown_ones_are_counted(tmp_path, monkeypatch):
    rules = tmp_path / "rules.yml"
    rules.write_text(RULES)
    monkeypatch.setattr(score_module, "evaluate_all", lambda timelines, *_a, **_k: [
        Evaluation(QUIET, {"Warn": AlertRecord(1, 1, 5, 1)})])
    lines = as_text(score([QUIET], [rules])).splitlines()
    assert lines[5:7] == ["Warn | warning | - | 0/0 | quiet (1x, 5 s)",
                          "(2 other alerts neither fired nor are expected to catch a failure here)"]
    assert "expected catches:" not in lines


def test_alert_severities_read_every_file(tmp_path):
    first, second, empty = tmp_path / "a.yml", tmp_path / "b.yml", tmp_path / "c.yml"
    first.write_text(RULES)
    second.write_text("groups:\n  - name: g\n    rules:\n      - alert: Bare\n        expr: up\n        labels:\n")
    empty.write_text("")
    assert score_module.alert_severities([first, second, empty]) == {
        "Page": "critical", "Warn": "warning", "NoSeverity": "none", "Bare": "none"}
