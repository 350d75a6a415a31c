"""`memtel demo --guard`: the report says what each phase did, with the numbers; the command shows it end to end."""

from __future__ import annotations

import json

import pytest

from harness.demo.guard_report import SUMMARY_FILE, Burst, Outcome, Phase, report_text, shown_as_expected, verdict
from harness.demo.guarded import BURST_PROMPTS, run
from telemetry.cli import main

OOM_LINE = "NVRM: ... Out of memory [NV_ERR_NO_MEMORY]"


def _phases(refused: bool = True, burst_queued: bool = True) -> list[Phase]:
    unguarded = Phase("unguarded", [Outcome("32k", 32768, 200, 0.2), Outcome("100k", 100000, 200, 0.6),
                                    Outcome("1M", 1048576, 500, 4.0, "InternalServerError", "EngineCore ..."),
                                    Outcome("next 32k", 32768, None, 0.01, message="Connection refused")],
                      node_alive_after=False, node_log_lines=[OOM_LINE])
    big = (Outcome("1M", 1048576, 503, 0.042, "memtel_would_not_fit", "...",
                   {"prompt_tokens": 1048576, "prompt_tokens_counted_by": "words", "limit_tokens": 401244,
                    "rank": "0", "node": "lab-a", "fit_budget_bytes": 1610612736}) if refused else
           Outcome("1M", 1048576, 500, 4.0, "InternalServerError", "EngineCore ..."))
    guarded = Phase("guarded", [Outcome("32k", 32768, 200, 0.2), Outcome("100k", 100000, 200, 0.6), big,
                                Outcome("next 32k", 32768, 200 if refused else None, 0.15)],
                    node_alive_after=refused, node_health_after=200 if refused else None, limit_tokens=401244)
    burst_u = Phase("burst unguarded", [Outcome("#1", 240746, 500, 0.61, "InternalServerError", "EngineCore ..."),
                                        Outcome("#2", 240746, None, 0.9, message="Connection reset")],
                    node_alive_after=False, node_log_lines=[OOM_LINE], burst=Burst(240746, 0.6, tenant_bytes=966367641))
    burst_g = Phase("burst guarded", [Outcome("#1", 240746, 200, 4.2), Outcome("#2", 240746, 200, 2.1)],
                    node_health_after=200,
                    burst=Burst(240746, 0.6, 60.0, tenant_bytes=966367641, tenant_held_s=1.4, limit_with_tenant=160301,
                                queued=2 if burst_queued else 1, forwarded_while_held=0 if burst_queued else 240746,
                                max_in_prefill_tokens=240746, queue_admitted=2, guard_rejected=0))
    return [unguarded, guarded, burst_u, burst_g]


def test_the_report_says_every_phase_with_the_numbers():
    phases = _phases()
    text = report_text(phases, 1.5)
    assert "| unguarded | 1M | 1,048,576 | 500 InternalServerError | 4.00 s |" in text
    assert "| unguarded | next 32k | 32,768 | no answer: Connection refused | 10 ms |" in text
    assert "| guarded | 1M | 1,048,576 | 503 memtel_would_not_fit | 42 ms |" in text
    assert "nothing answered: the server had exited" in text and "NV_ERR_NO_MEMORY" in text
    assert "got its 503 in 42 ms" in text and "limit of 401,244 set by rank 0 on node lab-a" in text
    assert "200 OK in 150 ms; the node kept serving" in text
    assert "| burst unguarded | #2 | 240,746 | no answer: Connection reset | 900 ms |" in text
    assert "| burst guarded | #1 | 240,746 | 200 OK | 4.20 s |" in text
    assert "takes 0.90 of its 1.5 GiB, and 2 prompts of 240,746 tokens (0.6 x the node's limit at rest, 401,244" in text
    assert "**Unguarded** (a fresh node): 2 of 2 failed: the first prefill ran out" in text
    assert "the guard's limit was 160,301 tokens. 2 of 2 waited in its queue and 0 prompt tokens reached" in text
    assert "gave it back after 1.4 s" in text and "at most 240,746 tokens in prefill at once" in text
    assert "2 of 2 completed, in 2.1 to 4.2 s" in text and "no NV_ERR_NO_MEMORY line" in text
    assert "Shown as expected: yes." in text
    facts = verdict(phases)
    assert shown_as_expected(facts)
    assert (facts["burst_unguarded_failed"], facts["burst_guarded_served"], facts["burst_guarded_queued"]) == (2, 2, 2)


@pytest.mark.parametrize("change", ["not refused", "burst forwarded", "burst did not die", "burst two at once"])
def test_a_run_that_did_not_show_it_is_not_shown_as_expected(change):
    phases = _phases(refused=change != "not refused", burst_queued=change != "burst forwarded")
    if change == "burst did not die":
        phases[2].outcomes = [Outcome(f"#{i}", 240746, 200, 0.5) for i in (1, 2)]
        phases[2].node_log_lines = []
    if change == "burst two at once":
        assert phases[3].burst is not None
        phases[3].burst.max_in_prefill_tokens = 2 * 240746
    facts = verdict(phases)
    assert not shown_as_expected(facts)
    assert "Shown as expected: no." in report_text(phases, 1.5)


def test_capacity_without_guard_is_one_line(capsys):
    assert main(["demo", "--capacity-gb", "2"]) == 2
    assert "--capacity-gb is for --guard" in capsys.readouterr().err


@pytest.mark.slow
def test_memtel_demo_guard_end_to_end(tmp_path, capsys):
    status = run(tmp_path)
    summary = json.loads((tmp_path / SUMMARY_FILE).read_text())   # written whatever the run showed
    facts = summary["facts"]
    # The burst while another tenant holds memory: unguarded some die; guarded none is forwarded while it would
    # not fit, then all complete, one at a time, with no out-of-memory on the node.
    assert facts["burst_unguarded_failed"] >= 1 and facts["burst_unguarded_out_of_memory"], facts
    assert facts["burst_guarded_served"] == facts["burst_guarded_queued"] == facts["burst_prompts"] == BURST_PROMPTS, \
        facts
    assert facts["burst_guarded_forwarded_while_held"] == 0 and facts["burst_guarded_one_at_a_time"], facts
    assert not facts["burst_guarded_out_of_memory"] and facts["burst_guarded_node_alive_after"], facts
    burst = summary["phases"][3]["burst"]
    assert burst["limit_with_tenant"] < burst["tokens"] <= summary["phases"][1]["limit_tokens"]
    assert facts["unguarded_1m_failed"] and not facts["unguarded_next_served"]
    assert facts["guarded_1m_refused"] and facts["guarded_next_served"] and facts["guarded_node_alive_after"]
    assert status == 0, capsys.readouterr()
    report = (tmp_path / "guard-report.md").read_text()
    # The 1M prompt's refusal: 503 memtel_would_not_fit, or the permanent 400 once the guard knows the node's at-best.
    assert ("memtel_would_not_fit" in report or "at best" in report) and "NV_ERR_NO_MEMORY" in report
    assert "## A burst while another tenant holds memory" in report
