"""results.jsonl: append-only, fsynced records that survive a kill mid-write; resume bookkeeping."""

from __future__ import annotations

import json

from harness.ab.records import RecordWriter, finished_steps, read_records, unstopped_servers


def test_records_survive_a_line_cut_by_a_kill(tmp_path):
    path = tmp_path / "results.jsonl"
    writer = RecordWriter(path)
    writer.write("request", arm="a", repeat=0, step="s1", ok=True)
    writer.close()
    with open(path, "a") as f:
        f.write('{"event": "request", "arm": "a", "rep')  # the harness died here
    assert [r["step"] for r in read_records(path)] == ["s1"]
    writer = RecordWriter(path)  # --resume appends after the broken line, not onto it
    writer.write("request", arm="a", repeat=0, step="s2", ok=False, error="boom")
    writer.close()
    records = read_records(path)
    assert [r["step"] for r in records] == ["s1", "s2"]
    assert all(json.loads(line) for line in path.read_text().splitlines()[:1])
    assert all(isinstance(r["ts"], float) for r in records)


def test_finished_steps_and_unstopped_servers():
    records = [
        {"event": "serve_start", "pgid": 11, "command": ["x"]},
        {"event": "request", "arm": "a", "repeat": 0, "step": "s1"},
        {"event": "serve_stop", "pgid": 11},
        {"event": "serve_start", "pgid": 22, "command": ["y"]},
        {"event": "request", "arm": "b", "repeat": 0, "step": "s1"},
        {"event": "step_skipped", "arm": "b", "repeat": 0, "step": "s3"},
    ]
    assert finished_steps(records) == {("a", 0, "s1"), ("b", 0, "s1"), ("b", 0, "s3")}
    assert [r["pgid"] for r in unstopped_servers(records)] == [22]
