"""`memtel allocsim FILE`: output format and bad-input messages, through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from telemetry.cli import main
from tests.support.cli import call_main

FIXTURE = (Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "allocator-truth"
           / "h200-torch2.11-expandable-segments-True.json")


def _write(tmp_path: Path, doc) -> Path:
    path = tmp_path / "ops.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def test_prints_one_row_per_op_matching_the_truth(capsys):
    assert main(["allocsim", str(FIXTURE)]) == 0
    out = json.loads(capsys.readouterr().out)
    truth = json.loads(FIXTURE.read_text())
    assert set(out["cases"]) == set(truth["cases"])
    for name, case in truth["cases"].items():
        assert out["cases"][name]["after"] == case["after"]


def test_check_mode_reports_agreement(capsys):
    assert main(["allocsim", "--check", str(FIXTURE)]) == 0
    assert "all rows agree" in capsys.readouterr().out


def test_check_mode_names_the_first_differing_op(tmp_path, capsys):
    rows = [[2097152, 512, 1, 0], [0, 0, 1, 0]]
    doc = {"config": "", "cases": {"c": {"ops": [["malloc", 1, 100], ["free", 1]], "after": rows}}}
    assert main(["allocsim", "--check", str(_write(tmp_path, doc))]) == 1
    assert "differs at op 1" in capsys.readouterr().out


def test_config_override_and_capacity(tmp_path, capsys):
    doc = {"config": "", "cases": {"c": {"ops": [["malloc", 1, 30 * 2**20], ["malloc", 2, 30 * 2**20]]}}}
    path = _write(tmp_path, doc)
    assert main(["allocsim", "--config", "expandable_segments:True", str(path)]) == 0
    rows = json.loads(capsys.readouterr().out)["cases"]["c"]["after"]
    assert rows[0][0] == 40 * 2**20  # two 20 MiB pages
    assert main(["allocsim", "--capacity-gb", "0.04", str(path)]) == 0
    rows = json.loads(capsys.readouterr().out)["cases"]["c"]["after"]
    assert rows[1][1] == rows[0][1]  # the second malloc ran out of memory


@pytest.mark.parametrize(
    "doc, words",
    [
        ({"config": "", "cases": {"warm": {"ops": [["malloc", 1, 10], ["frob", 1]]}}},
         ["case 'warm'", "op 1", "unknown op 'frob'"]),
        ({"config": "", "cases": {"c": {"ops": [["malloc", 1, 10], ["free", 2]]}}},
         ["case 'c'", "op 1", "unknown id 2"]),
        ({"config": "", "cases": {"c": {"ops": [["malloc", 1, 10], ["malloc", 1, 10]]}}}, ["op 1", "still live"]),
        ({"config": "", "cases": {"c": {"ops": [["malloc", 1, -5]]}}}, ["op 0", ">= 0"]),
        ({"config": "", "cases": {"c": {"ops": [["malloc", 1]]}}}, ["op 0", "size_bytes"]),
        ({"config": "max_split_size_mb:x", "cases": {"c": {"ops": []}}}, ["max_split_size_mb", "'x'"]),
        ({"config": "", "cases": {}}, ["'cases'"]),
        ({"config": "", "cases": {"c": {"after": []}}}, ["case 'c'", "'ops'"]),
        ("{not json", ["not valid JSON"]),
    ],
)
def test_bad_input_exits_nonzero_naming_case_op_and_problem(tmp_path, doc, words):
    done = call_main(["allocsim", str(_write(tmp_path, doc))])
    assert done.returncode != 0
    assert done.stdout == ""
    for word in words:
        assert word in done.stderr
    assert "Traceback" not in done.stderr


def test_missing_file(tmp_path, capsys):
    assert main(["allocsim", str(tmp_path / "nope.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
