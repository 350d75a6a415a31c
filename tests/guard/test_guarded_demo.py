"""`memtel demo --guard`: the report says what each phase did, with the numbers; the command shows it end to end."""

from __future__ import annotations

import json

import pytest

from harness.demo.guarded import SUMMARY_FILE, Outcome, Phase, report_text, run, shown_as_expected, verdict
from telemetry.cli import main


def _phases(refused: bool = True) -> tuple[Phase, Phase]:
    unguarded = Phase("unguarded", [Outcome("32k", 32768, 200, 0.2), Outcome("100k", 100000, 200, 0.6),
                                    Outcome("1M", 1048576, 500, 4.0, "InternalServerError", "EngineCore ..."),
                                    Outcome("next 32k", 32768, None, 0.01, message="Connection refused")],
                      node_alive_after=False, node_log_lines=["NVRM: ... Out of memory [NV_ERR_NO_MEMORY]"])
    big = (Outcome("1M", 1048576, 503, 0.042, "memtel_would_not_fit", "...",
                   {"prompt_tokens": 1048576, "prompt_tokens_counted_by": "words", "limit_tokens": 401244,
                    "rank": "0", "node": "lab-a", "fit_budget_bytes": 1610612736}) if refused else
           Outcome("1M", 1048576, 500, 4.0, "InternalServerError", "EngineCore ..."))
    guarded = Phase("guarded", [Outcome("32k", 32768, 200, 0.2), Outcome("100k", 100000, 200, 0.6), big,
                                Outcome("next 32k", 32768, 200 if refused else None, 0.15)],
                    node_alive_after=refused, node_health_after=200 if refused else None, limit_tokens=401244)
    return unguarded, guarded


def test_the_report_says_both_phases_with_the_numbers():
    unguarded, guarded = _phases()
    text = report_text(unguarded, guarded, 1.5)
    assert "| unguarded | 1M | 1,048,576 | 500 InternalServerError | 4.00 s |" in text
    assert "| unguarded | next 32k | 32,768 | no answer: Connection refused | 10 ms |" in text
    assert "| guarded | 1M | 1,048,576 | 503 memtel_would_not_fit | 42 ms |" in text
    assert "nothing answered: the server had exited" in text and "NV_ERR_NO_MEMORY" in text
    assert "got its 503 in 42 ms" in text and "limit of 401,244 set by rank 0 on node lab-a" in text
    assert "200 OK in 150 ms; the node kept serving" in text
    assert "Shown as expected: yes." in text
    assert shown_as_expected(verdict(unguarded, guarded))


def test_a_run_where_the_guard_did_not_refuse_is_not_shown_as_expected():
    unguarded, guarded = _phases(refused=False)
    facts = verdict(unguarded, guarded)
    assert not facts["guarded_1m_refused"] and not shown_as_expected(facts)
    assert "Shown as expected: no." in report_text(unguarded, guarded, 1.5)


def test_capacity_without_guard_is_one_line(capsys):
    assert main(["demo", "--capacity-gb", "2"]) == 2
    assert "--capacity-gb is for --guard" in capsys.readouterr().err


@pytest.mark.slow
def test_memtel_demo_guard_end_to_end(tmp_path, capsys):
    assert run(tmp_path) == 0, capsys.readouterr()
    summary = json.loads((tmp_path / SUMMARY_FILE).read_text())
    facts = summary["facts"]
    assert facts["unguarded_1m_failed"] and not facts["unguarded_next_served"]
    assert facts["guarded_1m_refused"] and facts["guarded_next_served"] and facts["guarded_node_alive_after"]
    report = (tmp_path / "guard-report.md").read_text()
    assert "memtel_would_not_fit" in report and "NV_ERR_NO_MEMORY" in report
