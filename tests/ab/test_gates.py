"""Gates: parsed and validated with the ladder; evaluated on synthetic runs with known answers; the verdict at the
top of report.md and in summary.json; the exit codes of `memtel ab report` (and so of `ab run`, which ends with
the same evaluation)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.ab.config import Ladder, LadderError
from harness.ab.gates import GATES
from harness.ab.report import Report
from harness.ab.report.verdict import (
    EXIT_GATE_FAILED,
    EXIT_OK,
    EXIT_REQUESTS_FAILED,
    EXIT_RUN_ERROR,
)
from tests.ab.synthetic import Values, ladder, write_run

ROOT = Path(__file__).resolve().parents[2]


def base(gates) -> dict:
    return {"model": "m", "arms": [{"name": "stock", "url": "http://127.0.0.1:1"},
                                   {"name": "fixed", "url": "http://127.0.0.1:2"}],
            "steps": [{"label": "s1", "tokens": 1000, "seed": 1}], "gates": gates}


@pytest.mark.parametrize("gates, message", [
    ([{"max_reserved_growth": 10}], "gates[0].max_reserved_growth: unknown gate 'max_reserved_growth'; valid gates: "
                                    + ", ".join(GATES)),
    ({"min_free_mib": 1}, "gates.min_free_mib: unknown gate 'min_free_mib'; valid gates:"),
    ([{"arm": "stock"}], "gates[0]: no gate in this item"),
    ([{"arm": "other", "max_nv_err_events": 0}],
     "gates[0].arm: 'other' is not an arm of this ladder; valid: stock, fixed"),
    ([{"step": "s9", "max_nv_err_events": 0}], "gates[0].step: 's9' is not a step of this ladder; valid: s1"),
    ([{"max_ttft_regression_pct": 10}], "needs `baseline`"),
    ([{"arm": "fixed", "baseline": "fixed", "max_ttft_regression_pct": 10}], "compare two different arms"),
    ([{"baseline": "stock", "max_nv_err_events": 0}], "`baseline` is only for max_ttft_regression_pct"),
    ([{"min_headroom_mib": -1}], "expected a number >= 0, got -1"),
    ([{"min_headroom_mib": "lots"}], "expected a finite number, got 'lots'"),
    ([{"min_headroom_mib": float("inf")}], "expected a finite number, got inf"),
    ("max_nv_err_events", "expected a list of gate items"),
])
def test_bad_gates_are_ladder_errors_naming_the_field(gates, message):
    with pytest.raises(LadderError, match=r"^x\.yaml: ") as error:
        Ladder.from_dict(base(gates), source="x.yaml")
    assert message in str(error.value)


def test_gates_survive_the_recorded_ladder():
    data = base([{"max_nv_err_events": 0, "min_mem_available_mib": 2048},
                 {"arm": "fixed", "baseline": "stock", "max_ttft_regression_pct": 10, "step": "s1"}])
    first = Ladder.from_dict(data)
    assert [g.name for g in first.gates] == ["max_nv_err_events", "min_mem_available_mib", "max_ttft_regression_pct"]
    again = Ladder.from_dict(json.loads(json.dumps(first.to_dict())))
    assert again == first and again.gates[2].baseline == "stock" and again.gates[2].step == "s1"


def test_unknown_gate_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "ladder.yaml"
    path.write_text(yaml.safe_dump(base([{"max_oom": 0}])))
    result = subprocess.run([sys.executable, "-m", "telemetry", "ab", "run", str(path), "--out", str(tmp_path / "r")],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{path}: gates[0].max_oom: unknown gate 'max_oom'; valid gates: max_reserved_growth_mib" in result.stderr
    assert not (tmp_path / "r").exists()


def values(stock_growth: float = 100.0, fixed_growth: float = 20.0, nv_err: int = 0, failed: bool = False) -> dict:
    out = {}
    for r in range(2):
        out[("stock", r, "s1")] = Values(ttft_s=1.0 + 0.1 * r, reserved_growth_mib=stock_growth, low_point_mib=300,
                                         headroom_low_mib=3000.0)
        out[("fixed", r, "s1")] = Values(ttft_s=1.2 + 0.1 * r, reserved_growth_mib=fixed_growth, low_point_mib=100,
                                         nv_err=nv_err if r == 1 else 0, headroom_low_mib=5000.0,
                                         ok=not (failed and r == 1))
    return out


def report_exit(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "telemetry", "ab", "report", str(run_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_gates_evaluated_with_known_answers(tmp_path):
    gates = [{"arm": "fixed", "max_reserved_growth_mib": 50},             # 20 MiB: pass
             {"arm": "stock", "max_reserved_growth_mib": 50},             # 100 MiB: fail
             {"min_mem_available_mib": 9900},                             # lowest: 10 GiB - 300 MiB = 9,940 MiB
             {"arm": "fixed", "min_headroom_mib": 4000},                  # 5,000 MiB: pass
             {"min_headroom_mib": 4000},                                  # stock's 3,000 MiB: fail
             {"max_nv_err_events": 0},
             {"arm": "fixed", "baseline": "stock", "max_ttft_regression_pct": 10}]  # 1.25 vs 1.05: +19.0 %
    write_run(tmp_path, values(), ladder(["stock", "fixed"], ["s1"], repeats=2, gates=gates))
    report = Report.build(tmp_path)
    results = report.verdict.gates
    assert [r.status for r in results] == ["pass", "fail", "pass", "pass", "fail", "pass", "fail"]
    assert results[0].observed == pytest.approx(20.0) and results[1].observed == pytest.approx(100.0)
    assert results[1].where == "stock repeat 0 s1, rank rank0" and results[1].checked == 2
    assert results[2].observed == pytest.approx(10 * 1024 - 300)
    assert results[4].observed == pytest.approx(3000.0) and results[4].where.startswith("stock repeat 0 s1, node n0")
    assert results[6].observed == pytest.approx((1.25 - 1.05) / 1.05 * 100)
    assert report.verdict.exit_code == EXIT_GATE_FAILED and report.verdict.outcome == "GATE FAILED"
    text = report.write().read_text().splitlines()
    assert text[0] == "# A/B report: stock, fixed"
    assert text[2].startswith("**Verdict: GATE FAILED** — 3 of 7 gates failed: max_reserved_growth_mib 50 "
                              "(arm stock): +100.0 MiB at stock repeat 0 s1, rank rank0 (+2 more); 4 of 4 requests ok")
    body = "\n".join(text)
    assert "## Gates" in body
    assert "| max_ttft_regression_pct | arm fixed, against stock, every step | 10 % | +19.0 % |" in body
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["verdict"]["exit_code"] == 3 and summary["verdict"]["outcome"] == "GATE FAILED"
    gate = summary["verdict"]["gates"][1]
    assert gate["observed"] == pytest.approx(100.0) and gate["limit"] == 50.0 and gate["status"] == "fail"
    result = report_exit(tmp_path)
    assert result.returncode == 3, result.stderr
    assert "Verdict: GATE FAILED — 3 of 7 gates failed" in result.stdout


def test_every_gate_passes_exit_0_and_no_gates_exit_0(tmp_path):
    gates = [{"max_nv_err_events": 0}, {"max_reserved_growth_mib": 200}]
    write_run(tmp_path / "pass", values(), ladder(["stock", "fixed"], ["s1"], repeats=2, gates=gates))
    result = report_exit(tmp_path / "pass")
    assert result.returncode == EXIT_OK, result.stdout + result.stderr
    assert "Verdict: PASS — 2 of 2 gates pass; 4 of 4 requests ok" in result.stdout
    write_run(tmp_path / "none", values(), ladder(["stock", "fixed"], ["s1"], repeats=2))
    result = report_exit(tmp_path / "none")
    assert result.returncode == EXIT_OK and "Verdict: COMPLETED — 4 of 4 requests ok; no gates, so nothing was " \
        "judged against a limit" in result.stdout


def test_a_driver_error_fails_its_gate(tmp_path):
    write_run(tmp_path, values(nv_err=2), ladder(["stock", "fixed"], ["s1"], repeats=2,
                                                 gates=[{"max_nv_err_events": 0}]))
    gate = Report.build(tmp_path).verdict.gates[0]
    assert (gate.status, gate.observed, gate.where) == ("fail", 2.0, "fixed repeat 1 s1, node n0")


@pytest.mark.slow
def test_failed_requests_exit_4_unless_a_gate_fails_too(tmp_path):
    write_run(tmp_path / "a", values(failed=True), ladder(["stock", "fixed"], ["s1"], repeats=2,
                                                          gates=[{"max_nv_err_events": 0}]))
    report = Report.build(tmp_path / "a")
    assert report.verdict.exit_code == EXIT_REQUESTS_FAILED and report.verdict.gates[0].passed
    assert report.verdict.gates[0].missing == ["fixed repeat 1 s1: the request failed"]
    assert report_exit(tmp_path / "a").returncode == 4
    # Failed requests and a failed gate: the gate wins (3).
    write_run(tmp_path / "b", values(failed=True), ladder(["stock", "fixed"], ["s1"], repeats=2,
                                                          gates=[{"max_reserved_growth_mib": 50}]))
    assert report_exit(tmp_path / "b").returncode == 3


def test_a_gate_with_nothing_to_check_fails(tmp_path):
    the_ladder = ladder(["stock", "fixed"], ["s1"], repeats=1, gates=[{"arm": "fixed", "max_reserved_growth_mib": 50}])
    write_run(tmp_path, {("stock", 0, "s1"): Values(ttft_s=1.0), ("fixed", 0, "s1"): Values(ttft_s=1.0, ok=False)},
              the_ladder)
    v = Report.build(tmp_path).verdict
    assert v.gates[0].status == "no data" and v.exit_code == EXIT_GATE_FAILED
    assert "no value to check" in v.line


def test_nothing_ran_and_unfinished_runs_exit_1(tmp_path):
    the_ladder = ladder(["stock", "fixed"], ["s1", "s2"], repeats=1)
    write_run(tmp_path / "none", {}, the_ladder)
    v = Report.build(tmp_path / "none").verdict
    assert (v.outcome, v.exit_code) == ("NOTHING RAN", EXIT_RUN_ERROR)
    write_run(tmp_path / "half", {("stock", 0, "s1"): Values(ttft_s=1.0)}, the_ladder, status="interrupted")
    v = Report.build(tmp_path / "half").verdict
    assert (v.outcome, v.exit_code, v.requests_not_run) == ("UNFINISHED", EXIT_RUN_ERROR, 3)
    assert report_exit(tmp_path / "half").returncode == 1
