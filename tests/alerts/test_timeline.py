"""Teeth for telemetry/alerts/timeline.py (issue 30's mutation testing): what a timeline file's header and records
may hold, and the one line that says what is wrong, read straight from `load_timeline` (test_score.py and
test_timeline_hostile.py run the same through `memtel alerts score`)."""

from __future__ import annotations

import gzip
import json
import tracemalloc
from pathlib import Path

import pytest

from telemetry.alerts import timeline as timeline_module
from telemetry.alerts.timeline import load_timeline
from telemetry.errors import ConfigError, shown

T0 = 1_764_547_200.0
RECORD = {"time": T0, "values": {"memtel_node_unified_headroom_bytes": 3e10}}


def write(path: Path, header: dict, *records: dict) -> Path:
    path.write_text("\n".join(json.dumps(line) for line in [{"memtel_timeline": header}, *(records or [RECORD])]))
    return path


def refused(path: Path) -> str:
    with pytest.raises(ConfigError) as error:
        load_timeline(path)
    return str(error.value)


def test_a_header_says_only_the_outcome_and_the_rest_has_defaults(tmp_path):
    line = load_timeline(write(tmp_path / "quiet.jsonl", {"outcome": "benign"}))
    assert (line.name, line.outcome.node, line.outcome.description, line.outcome.expect) == \
        ("quiet", "corpus-node", "", ())


def test_a_failure_at_the_first_record_is_a_timeline(tmp_path):
    line = load_timeline(write(tmp_path / "t.jsonl", {"outcome": "failure", "failure_at": T0}))
    assert line.outcome.failure_at == line.start == T0


@pytest.mark.parametrize("header, message", [
    ({"outcome": "benign", "node": "-" + "x" * 100},
     f"node must be a host name (letters, digits, . _ : -), got {shown('-' + 'x' * 100, 40)}"),
    ({"outcome": "benign", "description": "x" * 2001}, "description must be text of at most 2000 characters"),
    ({"outcome": "benign", "description": 5}, "description must be text of at most 2000 characters"),
    ({"outcome": "failure", "failure_at": T0 + 1, "expect": [{"alert": "A", "colour": 1}]},
     "expect[0] must be an object with 'alert' or 'severity' (or both) and optionally 'within_s'"),
    ({"outcome": "failure", "failure_at": T0 + 1, "expect": ["A"]},
     "expect[0] must be an object with 'alert' or 'severity' (or both) and optionally 'within_s'"),
    ({"outcome": "failure", "failure_at": T0 + 1, "expect": [{"within_s": 5}]},
     "expect[0] must be an object with 'alert' or 'severity' (or both) and optionally 'within_s'"),
    ({"outcome": "failure", "failure_at": T0 + 1, "expect": [{"alert": "A", "severity": "page"}]},
     "expect[0].severity must be one of critical, warning, got 'page'"),
    ({"outcome": "failure", "failure_at": T0 + 1, "expect": [{"alert": "A", "within_s": "soon"}]},
     "expect[0].within_s: expected a finite number, got 'soon'"),
    ({"outcome": "failure", "failure_at": T0 + 1, "expect": [{"alert": "A", "within_s": 1e6}]},
     "expect[0].within_s must be seconds from 0 to 100000, got 1000000.0"),
    ({"outcome": "benign", "onset_at": -1}, "onset_at: expected Unix seconds from 0 to 4294967296 (the year 2106), "
                                            "got -1"),
])
def test_a_bad_header_is_named_with_what_it_holds(tmp_path, header, message):
    path = write(tmp_path / "t.jsonl", header)
    assert refused(path) == f"{path}:1: {message}"


def test_a_second_header_is_refused(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in [{"memtel_timeline": {"outcome": "benign"}}, RECORD,
                                                            {"memtel_timeline": {"outcome": "benign"}}]))
    assert refused(path) == f"{path}:3: a second memtel_timeline line (a timeline has one outcome)"


def test_a_bad_series_name_is_quoted(tmp_path):
    path = write(tmp_path / "t.jsonl", {"outcome": "benign"}, {"time": T0, "values": {"a b": 1}})
    assert refused(path) == f"{path}:2: 'a b' is not a series name (name or name{{label=\"value\",...}})"


def test_a_file_that_cannot_be_read_says_why(tmp_path):
    (tmp_path / "dir.jsonl").mkdir()
    assert refused(tmp_path / "dir.jsonl") == f"{tmp_path / 'dir.jsonl'}: cannot read: Is a directory"


def test_a_gzip_bomb_is_unpacked_no_further_than_the_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(timeline_module, "MAX_TIMELINE_BYTES", 100_000)
    path = tmp_path / "bomb.jsonl.gz"
    path.write_bytes(gzip.compress(b" " * (16 << 20), compresslevel=9))   # 16 MiB of blanks, 16 KiB packed
    assert path.stat().st_size < 100_000
    tracemalloc.start()
    try:
        message = refused(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert message == f"{path}: unpacks to more than 100000 bytes"
    assert peak < 4 << 20, peak   # the 16 MiB were never held
