"""Teeth for `memtel alerts` (telemetry/alerts/cli.py, issue 30's mutation testing): its flags, its exit
status and its two outputs, in-process (tests/support/cli.py). promtool checks the rules for real; what the
rules did on the timeline is handed to the score by hand (test_score.py says why)."""

from __future__ import annotations

import json
import os
import re

import pytest

from telemetry.alerts import cli as alerts_cli
from telemetry.alerts import score as score_module
from telemetry.alerts.promtool import AlertRecord, Evaluation
from telemetry.errors import ConfigError
from tests.support.cli import call_main

T0 = 1_764_547_200.0
RULES = """
groups:
  - name: alerts
    rules:
      - alert: Page
        expr: memtel_node_unified_headroom_bytes < 1
        labels: {severity: critical}
"""


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "quiet.jsonl"
    path.write_text(json.dumps({"memtel_timeline": {"outcome": "benign"}}) + "\n" + "".join(
        json.dumps({"time": T0 + i, "values": {"memtel_node_unified_headroom_bytes": 5}}) + "\n" for i in range(3)))
    rules = tmp_path / "rules.yml"
    rules.write_text(RULES)
    return path, rules


def fired(monkeypatch, record: AlertRecord) -> None:
    monkeypatch.setattr(score_module, "evaluate_all", lambda timelines, *_a, **_k: [
        Evaluation(t, {"Page": record}) for t in timelines])


def test_a_quiet_score_is_exit_0_as_text_or_json(corpus, monkeypatch):
    path, rules = corpus
    fired(monkeypatch, AlertRecord())
    run = call_main(["alerts", "score", str(path), "--rules", str(rules)])
    assert (run.returncode, run.stderr) == (0, "")
    assert run.stdout.startswith(f"rules: {rules}\n") and run.stdout.endswith("problems: none\n")
    run = call_main(["alerts", "score", str(path), "--rules", str(rules), "--json"])
    assert run.returncode == 0 and json.loads(run.stdout)["problems"] == []
    assert run.stdout.startswith('{\n "rule_files"')   # indented by one


def test_a_page_on_a_benign_timeline_is_exit_1(corpus, monkeypatch):
    path, rules = corpus
    fired(monkeypatch, AlertRecord(0, 2, 3, 1))
    run = call_main(["alerts", "score", str(path), "--rules", str(rules), "--json"])
    assert run.returncode == 1, run.stderr
    assert json.loads(run.stdout)["problems"] == [
        "Page (critical) pages on benign timeline quiet (1 time(s), 3 s firing)"]


def test_without_an_action_it_says_which_there_are():
    run = call_main(["alerts"])
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == "memtel alerts: choose an action: score or burn-in (see memtel alerts --help)\n"


def test_the_corpus_is_read_before_the_rules_are_checked(tmp_path):
    (tmp_path / "bad.jsonl").write_text("[]\n")
    run = call_main(["alerts", "score", str(tmp_path / "bad.jsonl"), "--rules", str(tmp_path / "no-rules.yml")])
    assert run.returncode == 2 and "bad.jsonl:1: not a JSON object" in run.stderr, run.stderr


@pytest.mark.parametrize("argv, message", [
    (["--minutes", "1441"], "--minutes 1441: expected 0.5 to 1440"),
    (["--minutes", "0.49"], "--minutes 0.49: expected 0.5 to 1440"),
    (["--minutes", "1", "--out", "/nonexistent-dir/t.jsonl"],
     "--out /nonexistent-dir/t.jsonl: the directory /nonexistent-dir does not exist"),
])
def test_burn_in_refuses_bad_input_before_it_starts_the_daemon(argv, message):
    run = call_main(["alerts", "burn-in", *argv])
    assert run.returncode == 2 and run.stdout == "" and message in run.stderr and run.stderr.count("\n") == 1


def test_burn_in_checks_the_rules_before_it_records(tmp_path):
    run = call_main(["alerts", "burn-in", "--minutes", "1", "--rules", str(tmp_path / "none.yml")])
    assert run.returncode == 2 and f"--rules {tmp_path / 'none.yml'}: no such file" in run.stderr


def test_the_default_rules_are_the_shipped_files_in_order():
    recording, alerts = alerts_cli.default_rules()
    assert (recording.name, alerts.name) == alerts_cli.RULE_FILES == ("memtel-recording.yml", "memtel-alerts.yml")
    assert recording.is_file() and alerts.is_file() and recording.parent.name == "rules"


def test_a_missing_shipped_rule_file_says_to_name_them(monkeypatch):
    monkeypatch.setattr(alerts_cli, "RULE_FILES", ("memtel-recording.yml", "gone.yml"))
    with pytest.raises(ConfigError, match=re.escape("the shipped rule file gone.yml is missing from this install of "
                                                    "memtel; name the rule files with --rules FILE ...")):
        alerts_cli.default_rules()


@pytest.mark.parametrize("action, said", [
    ("score", ["CORPUS", "--rules FILE [FILE ...]", "--json",
               "Score alert rules against timelines whose outcome is known.",
               "(default: the shipped memtel-recording.yml and memtel-alerts.yml)"]),
    ("burn-in", ["--minutes N", "--out FILE.jsonl", "--rules FILE [FILE ...]", "--state-dir DIR",
                 "--listen HOST:PORT", "--json",
                 "Run the memtel daemon with its flight recorder for N minutes, then score the rules on the "
                 "recorded timeline as a benign one.",
                 "the daemon's state directory for the run (default: a new temporary directory)",
                 "where the burn-in's daemon listens (default 127.0.0.1 on a free port)"]),
])
def test_each_action_says_its_flags_and_their_defaults(action, said):
    run = call_main(["alerts", action, "--help"], env={**os.environ, "COLUMNS": "400"})  # no line breaks
    assert run.returncode == 0
    text = " ".join(run.stdout.split())
    for words in said:   # each as written, between blanks
        assert re.search(rf"(?<!\S){re.escape(words)}(?!\S)", text), (words, run.stdout)
