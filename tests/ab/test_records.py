"""results.jsonl: typed records written and read through the same dataclasses; lines cut by a kill,
records of an earlier version, and records that cannot be read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.ab.records import (
    NodeSample,
    NodeSnapshot,
    RankSnapshot,
    RecordError,
    RecordWriter,
    RequestDone,
    Scrape,
    ServerSnapshot,
    ServeStart,
    ServeStop,
    StepSkipped,
    finished_steps,
    read_records,
    unstopped_servers,
)

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parent / "fixtures" / "cpu-vllm-repeats" / "results.jsonl"


def request(step: str, ok: bool = True, **changes) -> RequestDone:
    fields = dict(arm="a", repeat=0, step=step, seed=1, target_tokens=4000, prompt_tokens=4000, prompt_sha256="x",
                  ok=ok, started_at=10.0, ended_at=12.5)
    return RequestDone(**{**fields, **changes})


def test_records_are_read_back_as_the_types_that_wrote_them(tmp_path):
    path = tmp_path / "results.jsonl"
    writer = RecordWriter(path)
    written = [
        writer.write(request("s1", usage_prompt_tokens=4000, prompt_tokens_match=True, ttft_s=0.25,
                             min_mem_available_bytes={"n": 1.0e9})),
        writer.write(Scrape(phase="after", arm="a", repeat=0, step="s1",
                            nodes={"n": NodeSnapshot(ts=3.0, mem_available_bytes=2.0e9, xid_by_code={"79": 1.0})},
                            ranks={"rank0": RankSnapshot(reserved_bytes=1024.0, num_device_alloc=2.0),
                                   "rank1": RankSnapshot(error="ConnectError: refused")},
                            server=ServerSnapshot(ttft_sum_s=1.5, ttft_count=2.0))),
        writer.write(NodeSample(arm="a", repeat=0, step="s1", node="n",
                                snapshot=NodeSnapshot(ts=4.0, mem_available_bytes=1.5e9, swap_used_bytes=0.0))),
    ]
    writer.close()
    read = read_records(path)
    assert [type(r) for r in read] == [RequestDone, Scrape, NodeSample]
    assert read[:2] == written[:2]
    assert all(isinstance(r.ts, float) and r.ts > 1e9 for r in read)
    sample = read[2]
    assert isinstance(sample, NodeSample) and sample.snapshot.mem_available_bytes == 1.5e9
    # A node sample keeps its snapshot's fields on the line itself (easy to grep and to plot).
    line = json.loads(path.read_text().splitlines()[2])
    assert line["event"] == "node_sample" and line["mem_available_bytes"] == 1.5e9 and "snapshot" not in line


def test_records_survive_a_line_cut_by_a_kill(tmp_path):
    path = tmp_path / "results.jsonl"
    writer = RecordWriter(path)
    writer.write(request("s1"))
    writer.close()
    with open(path, "a") as f:
        f.write('{"event": "request", "arm": "a", "rep')  # the harness died here
    assert [r.step for r in read_records(path) if isinstance(r, RequestDone)] == ["s1"]
    writer = RecordWriter(path)  # --resume appends after the broken line, not onto it
    writer.write(request("s2", ok=False, error="boom"))
    writer.close()
    assert [(r.step, r.ok) for r in read_records(path) if isinstance(r, RequestDone)] == [("s1", True), ("s2", False)]


def test_an_unknown_event_of_a_newer_writer_is_skipped(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text('{"event": "gate_verdict", "ts": 1.0, "verdict": "pass"}\n'
                    + json.dumps(StepSkipped(arm="a", repeat=0, step="s", reason="x").to_json()) + "\n")
    assert read_records(path) == [StepSkipped(arm="a", repeat=0, step="s", reason="x")]


def test_records_of_an_earlier_version_are_read_under_todays_names():
    records = read_records(FIXTURE)
    req = next(r for r in records if isinstance(r, RequestDone))
    line = next(json.loads(x) for x in FIXTURE.read_text().splitlines() if '"event": "request"' in x)
    # Before: `tokens` (the step's target), `prompt_token_count` (built) and `prompt_tokens` (the usage).
    assert (req.target_tokens, req.prompt_tokens, req.usage_prompt_tokens) == (
        line["tokens"], line["prompt_token_count"], line["prompt_tokens"])
    scrape = next(r for r in records if isinstance(r, Scrape) and r.phase == "after")
    old = next(json.loads(x) for x in FIXTURE.read_text().splitlines() if '"phase": "after"' in x)
    assert scrape.ranks["rank0"].hook_calls_total == old["ranks"]["rank0"]["hook_calls_total"]
    assert "device_alloc_total" in old["ranks"]["rank0"]  # renamed num_device_alloc (absent series: None)
    assert scrape.ranks["rank0"].num_device_alloc == old["ranks"]["rank0"]["device_alloc_total"]


def test_a_record_without_a_field_it_needs_is_one_clear_error(tmp_path):
    path = tmp_path / "results.jsonl"
    broken = request("s1").to_json()
    del broken["arm"]
    path.write_text(json.dumps(StepSkipped(arm="a", repeat=0, step="s", reason="x").to_json()) + "\n"
                    + json.dumps(broken) + "\n")
    with pytest.raises(RecordError, match=r"results.jsonl:2: the request record has no 'arm' field"):
        read_records(path)


def test_memtel_ab_report_on_a_broken_record_says_so_in_one_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = FIXTURE.read_text().splitlines()
    first_request = next(i for i, line in enumerate(lines) if '"event": "request"' in line)
    record = json.loads(lines[first_request])
    del record["started_at"]
    lines[first_request] = json.dumps(record)
    (run / "results.jsonl").write_text("\n".join(lines) + "\n")
    result = subprocess.run([sys.executable, "-m", "telemetry", "ab", "report", str(run)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"memtel ab report: error: {run / 'results.jsonl'}:{first_request + 1}: the request record has no 'started_at' "
        "field (written by another memtel version, or edited?)"]


def test_finished_steps_and_unstopped_servers():
    records = [
        ServeStart(arm="a", repeat=0, command=["x"], env={}, cwd=None, pid=11, pgid=11, log="l"),
        request("s1"),
        ServeStop(pgid=11, how="sigterm"),
        ServeStart(arm="b", repeat=0, command=["y"], env={}, cwd=None, pid=22, pgid=22, log="l"),
        request("s1", arm="b"),
        StepSkipped(arm="b", repeat=0, step="s3", reason="server died"),
    ]
    assert finished_steps(records) == {("a", 0, "s1"), ("b", 0, "s1"), ("b", 0, "s3")}
    assert [r.pgid for r in unstopped_servers(records)] == [22]


@pytest.mark.parametrize("field, value, words", [
    ("ok", "yes", "'ok' is 'yes', expected bool"),
    ("repeat", True, "'repeat' is True, expected int"),
    ("ttft_s", "fast", "'ttft_s' is 'fast', expected float | None"),
    ("min_mem_available_bytes", [1], "'min_mem_available_bytes' is [1], expected dict[str, float]"),
])
def test_a_field_of_the_wrong_type_is_a_clear_error(tmp_path, field, value, words):
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps({**request("s1").to_json(), field: value}) + "\n")
    with pytest.raises(RecordError, match=r"results.jsonl:1: the request record cannot be read: ") as caught:
        read_records(path)
    assert words in str(caught.value)
