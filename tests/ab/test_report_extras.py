"""What a report's first writer added (harness/ab/report/extras.py): `memtel ab report` written again on a demo's
run keeps the demo's section, its note and its plot caveat (issue 40: it dropped them without a word); a file
in its place that is not theirs is one line and exit 2."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from harness.ab.report import Report, Section
from harness.ab.report.extras import EXTRAS_FILE
from harness.ab.runner import RUN_DIR_ENTRIES
from tests.support.cli import call_main

RUN = Path(__file__).resolve().parent / "fixtures" / "cpu-vllm-repeats"
NOTE = "the difference between the arms is not the fix's effect"


@pytest.fixture
def run_dir(tmp_path):
    target = tmp_path / "run"
    shutil.copytree(RUN, target)
    return target


def test_ab_report_written_again_keeps_the_first_writers_section_note_and_caveat(run_dir):
    section = Section("demo", "About this run (memtel demo)", "The lab model cannot read.", placement="lead",
                      data={"prediction_agrees": True, "ratio": float("nan"), "count": np.int64(3)})  # as summary.json
    Report.build(run_dir).write([section], {"ttft": [NOTE]}, {"ttft": "not the fix's effect"})
    first = (run_dir / "report.md").read_text()
    (run_dir / "report.md").unlink()
    result = call_main(["ab", "report", str(run_dir)])
    assert result.returncode == 0, result.stderr
    again = (run_dir / "report.md").read_text()
    assert "## About this run (memtel demo)" in again and NOTE in again and again == first


def test_a_file_in_its_place_that_is_not_theirs_is_one_line_and_exit_2(run_dir):
    (run_dir / EXTRAS_FILE).write_text('{"sections": [{"key": 1}], "notes": {}, "plot_caveats": {}}')
    result = call_main(["ab", "report", str(run_dir)])
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"memtel ab report: error: {run_dir / EXTRAS_FILE} is not what a report's writer keeps there" in \
        result.stderr


def test_overwrite_removes_the_extras_with_the_report():
    assert EXTRAS_FILE in RUN_DIR_ENTRIES
