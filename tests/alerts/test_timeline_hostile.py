"""A timeline is data, never verdicts, and bounded before promtool sees it (issue 27): a file carrying
`ALERTS{alertstate="firing"}` scored a failure nobody caught as "caught"; two records 1e8 s apart took 244 s and
2.7 GB and crashed promtool; 1e15 or +-1e300 were tracebacks; 10^6 series took over 400 s. Each is now one line
naming the file, the line and what is wrong (or the cap), exit 2, before promtool runs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from telemetry.alerts import timeline as timeline_module
from telemetry.alerts.cli import default_rules
from telemetry.alerts.score import score
from telemetry.alerts.timeline import load_timeline
from telemetry.errors import ConfigError
from tests.support.cli import call_main

T0 = 1_764_547_200.0


def cli(*argv: str) -> tuple[int, str, str]:
    """`memtel ARGV` in-process (tests/support/cli.py): (exit code, stdout, stderr)."""
    run = call_main(list(argv))
    return run.returncode, run.stdout, run.stderr


HEADER = {"memtel_timeline": {"outcome": "failure", "failure_at": T0 + 30, "node": "spark-a",
                              "expect": [{"alert": "MemtelUnifiedHeadroomLow", "within_s": 5}]}}


def write(path: Path, records: list[dict], header: dict = HEADER) -> Path:
    path.write_text("\n".join(json.dumps(line) for line in [header, *records]) + "\n")
    return path


def record(t: float, **values: float) -> dict:
    return {"time": t, "values": {"memtel_node_unified_headroom_bytes": 3.1e10, **values}}


def one_line_exit_2(path: Path) -> str:
    code, out, err = cli("alerts", "score", str(path))
    assert code == 2 and out == "" and "Traceback" not in err, err
    (line,) = err.strip().splitlines()
    assert len(line) < 400, line
    return line


@pytest.mark.parametrize("series", ['ALERTS{alertname="MemtelUnifiedHeadroomLow",alertstate="firing"}',
                                    'ALERTS_FOR_STATE{alertname="MemtelUnifiedHeadroomLow"}'])
def test_an_alerts_series_in_a_timeline_is_refused(tmp_path, series):
    path = write(tmp_path / "forged.jsonl", [record(T0), {"time": T0 + 1, "values": {series: 1}}])
    line = one_line_exit_2(path)
    assert f"{path}:3:" in line and "written by the rule engine" in line and series.split("{")[0] in line


def test_a_recording_rules_output_in_a_timeline_is_refused_before_promtool(tmp_path):
    outputs = timeline_module.rule_outputs(default_rules())   # read from the shipped rule files
    assert {"ALERTS", "ALERTS_FOR_STATE", "memtel:unified_headroom_low_threshold_bytes",
            "instance:memtel_node_mem_available:ratio"} <= outputs
    path = write(tmp_path / "forged.jsonl", [record(T0), record(T0 + 1),
                                             record(T0 + 2, **{"memtel:unified_headroom_low_threshold_bytes": 1e12})])
    with pytest.raises(ConfigError, match=rf"^{path}:4: series 'memtel:unified_headroom_low_threshold_bytes' is "
                                          "written by the rule engine"):
        score([load_timeline(path)], default_rules())


def test_records_1e8_s_apart_are_refused_fast(tmp_path):
    path = write(tmp_path / "far.jsonl", [record(T0), record(T0 + 1e8)])
    start = time.monotonic()
    line = one_line_exit_2(path)
    assert time.monotonic() - start < 1.0
    assert f"{path}:3:" in line and "may span at most 100,000 s" in line


@pytest.mark.parametrize("when", ["1e15", "1e300", "-1e300", "NaN", "Infinity", "-1", "9" * 400, "9" * 5000],
                         ids=["1e15", "1e300", "-1e300", "nan", "inf", "negative", "400-digits", "5000-digits"])
def test_a_time_that_is_no_unix_time_is_one_line(tmp_path, when):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(HEADER) + "\n" + f'{{"time": {when}, "values": {{"a": 1}}}}\n')
    line = one_line_exit_2(path)
    assert f"{path}:2:" in line and ("Unix seconds from 0" in line or "finite number" in line
                                     or "not a JSON object" in line)


@pytest.mark.parametrize("field, value", [("failure_at", 1e15), ("onset_at", -1e300), ("failure_at", 10**400)],
                         ids=["failure_at-1e15", "onset_at--1e300", "failure_at-400-digits"])
def test_outcome_times_are_bounded_too(tmp_path, field, value):
    header = {"memtel_timeline": {**HEADER["memtel_timeline"], field: value}}
    line = one_line_exit_2(write(tmp_path / "t.jsonl", [record(T0)], header))
    assert f"{field}: expected" in line


def test_a_huge_value_is_one_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(HEADER) + "\n" + '{"time": 1764547200, "values": {"a": ' + "9" * 400 + "}}\n")
    assert "past a float's range" in one_line_exit_2(path)


def test_more_series_than_the_cap_is_refused_naming_it(tmp_path):
    records = [{"time": T0 + i, "values": {f"s{i}_{j}": 1 for j in range(1000)}} for i in range(11)]
    line = one_line_exit_2(write(tmp_path / "wide.jsonl", records))
    assert "more than 10,000 series" in line and ":12:" in line


def test_more_records_than_the_cap_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(timeline_module, "MAX_RECORDS", 5)
    line = one_line_exit_2(write(tmp_path / "long.jsonl", [record(T0 + i) for i in range(6)]))
    assert "more than 5 records" in line


def test_a_1_mb_series_name_is_cut_in_the_error(tmp_path):
    path = write(tmp_path / "t.jsonl", [{"time": T0, "values": {"bad name " + "x" * 1_000_000: 1}}])
    assert "is not a series name" in one_line_exit_2(path)



def test_span_times_series_past_the_cap_is_refused_before_promtool(tmp_path):
    """Issue 41: a timeline within every other cap (100,000 s, 10,000 series) ran promtool past 300 s or to a
    MemoryError; its seconds x series are bounded too."""
    records = [{"time": T0, "values": {f"s{j}": 1 for j in range(80)}}, record(T0 + 99_999)]
    line = one_line_exit_2(write(tmp_path / "wide-and-long.jsonl", records))
    assert "100,000 s x 82 series is 8,200,000 series-seconds; a timeline may hold at most 8,000,000" in line


@pytest.mark.parametrize("record_line, message", [
    ({"time": T0, "up": 2, "values": {}}, "up must be 1 (the node's scrape answered) or 0 (it failed), got 2"),
    ({"time": T0, "up": 0, "values": {"a": 1}}, "a record with up 0 is a failed scrape and carries no values"),
    ({"time": T0, "values": {"up": 0}}, "an `up` series names its target's job"),
    ({"time": T0, "values": {'up{job="memtel-daemon"}': 0}}, "an `up` series names its target's job"),
])
def test_a_bad_scrape_record_is_one_line(tmp_path, record_line, message):
    assert message in one_line_exit_2(write(tmp_path / "t.jsonl", [record_line]))


def test_a_failed_scrape_and_a_hooks_up_load(tmp_path):
    line = load_timeline(write(tmp_path / "t.jsonl", [
        {"time": T0, "values": {'up{job="memtel-hook",instance="a:9400"}': 1}},
        {"time": T0 + 1, "up": 0, "values": {}}]))
    assert [r.up for r in line.records] == [True, False] and line.series == 1 and line.work == 2 * 2
