"""Bad snapshot and trace files: one clear line, exit 2, no traceback, nothing run from a pickle."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

from telemetry.model.allocsim.recorder import RecordingSim
from telemetry.model.allocsim.snapshot import SnapshotError, read_allocator_state
from telemetry.model.allocsim.snapshot_file import SnapshotFileError, parse_snapshot_bytes, read_snapshot_file
from tests.support.cli import call_main

REPO = Path(__file__).resolve().parents[2]
CAPTURE = REPO / "tests" / "fixtures" / "allocator-snapshots" / "h200-torch2.11"
RECORDED = CAPTURE / "whatif-recorded.pickle.gz"
SEEDED = CAPTURE / "seeded-default-stock-state24k.snapshot.json.gz"
MIB = 1024 * 1024


def memtel(*args: str, cwd: Path = REPO, shell: bool = False) -> subprocess.CompletedProcess[str]:
    """`memtel ARGS` in this process (tests/support/cli.py); with `shell`, through a fresh Python: where a
    hostile file could run code, a FIFO could block, or a defect could read gigabytes, and for the exit
    status the shell sees."""
    if not shell:
        return call_main(list(args), cwd=cwd)
    return subprocess.run([sys.executable, "-m", "telemetry.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def assert_refused(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    for word in words:
        assert word in done.stderr, done.stderr


def _ops_file(tmp_path: Path) -> Path:
    path = tmp_path / "ops.json"
    path.write_text(json.dumps({"config": "", "cases": {"c": {"ops": [["malloc", 1, 5 * MIB], ["free", 1]]}}}))
    return path


def _recorded_doc() -> dict:
    return pickle.loads(gzip.decompress(RECORDED.read_bytes()))  # our own fixture, made by torch


class Hostile:
    """Unpickling this runs a shell command that creates a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_hostile_pickle_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps({"segments": [], "device_traces": [[Hostile(marker)]]}))
    for command in (["whatif", str(evil)], ["forecast", "--snapshot", str(evil), "--tokens", "1000"],
                    ["allocsim", str(_ops_file(tmp_path)), "--from-snapshot", str(evil)]):
        assert_refused(memtel(*command, shell=True), "posix.system", "refused")
    assert not marker.exists()
    # gzip-compressed, the same
    (tmp_path / "evil.pickle.gz").write_bytes(gzip.compress(evil.read_bytes()))
    assert_refused(memtel("whatif", str(tmp_path / "evil.pickle.gz"), shell=True), "refused")
    assert not marker.exists()


@pytest.mark.parametrize("payload, words", [
    (pickle.dumps([1, 2, 3]), ["not a memory snapshot", "segment 0 is a int"]),
    (pickle.dumps({"weights": [0.5]}), ["not a memory snapshot", "weights"]),
    (pickle.dumps("hello"), ["not a memory snapshot"]),
])
def test_a_pickle_that_is_not_a_snapshot(tmp_path, payload, words):
    path = tmp_path / "other.pickle"
    path.write_bytes(payload)
    assert_refused(memtel("allocsim", str(_ops_file(tmp_path)), "--from-snapshot", str(path)), *words)


def test_a_pickle_that_is_not_a_trace(tmp_path):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"segments": []}))
    assert_refused(memtel("whatif", str(path)), "not a recorded memory history", "_record_memory_history")


def test_a_truncated_pickle(tmp_path):
    data = gzip.decompress(RECORDED.read_bytes())
    path = tmp_path / "cut.pickle"
    path.write_bytes(data[: len(data) // 2])
    assert_refused(memtel("whatif", str(path)), "truncated or corrupt pickle")
    cut_gzip = tmp_path / "cut.pickle.gz"
    cut_gzip.write_bytes(RECORDED.read_bytes()[:-100])
    assert_refused(memtel("whatif", str(cut_gzip)), "gzip")


def test_a_trace_from_several_streams(tmp_path):
    doc = _recorded_doc()
    entries = doc["device_traces"][0]
    for entry in entries[len(entries) // 2:]:
        if entry["action"] != "snapshot":
            entry["stream"] = 0x55AA00
    path = tmp_path / "streams.pickle"
    path.write_bytes(pickle.dumps(doc))
    assert_refused(memtel("whatif", str(path)), "several CUDA streams", "0x55aa00")


def test_a_trace_of_several_devices_needs_device(tmp_path):
    doc = _recorded_doc()
    doc["device_traces"] = [doc["device_traces"][0], list(doc["device_traces"][0])]
    path = tmp_path / "two.pickle"
    path.write_bytes(pickle.dumps(doc))
    assert_refused(memtel("whatif", str(path)), "several devices (0, 1)", "--device")
    done = memtel("whatif", str(path), "--device", "0", "--json")
    assert done.returncode == 0, done.stderr
    assert_refused(memtel("whatif", str(path), "--device", "5"), "no history of device 5")


def test_a_trace_with_an_unknown_action(tmp_path):
    doc = _recorded_doc()
    doc["device_traces"][0].insert(3, {"action": "teleport", "addr": 0, "size": 0, "stream": 0})
    path = tmp_path / "odd.pickle"
    path.write_bytes(pickle.dumps(doc))
    assert_refused(memtel("whatif", str(path)), "unknown action 'teleport'", "entry 3")


def test_a_trace_with_private_pool_allocations(tmp_path):
    doc = _recorded_doc()
    for entry in doc["device_traces"][0][:20]:
        entry["pool_id"] = (1, 0)
    path = tmp_path / "graphs.pickle"
    path.write_bytes(pickle.dumps(doc))
    assert_refused(memtel("whatif", str(path)), "private memory pools")


def _move(segment: dict, address: int) -> None:
    shift = address - segment["address"]
    segment["address"] = address
    for block in segment["blocks"]:
        block["address"] += shift


def _segments() -> list:
    return json.loads(gzip.decompress(SEEDED.read_bytes()))


def test_a_snapshot_with_an_unknown_block_state(tmp_path):
    segments = _segments()
    segments[3]["blocks"][0]["state"] = "active_awaiting_free"
    path = tmp_path / "odd.json"
    path.write_text(json.dumps(segments))
    done = memtel("allocsim", str(_ops_file(tmp_path)), "--from-snapshot", str(path))
    assert_refused(done, "unknown block state 'active_awaiting_free'", "segment 3")
    assert_refused(memtel("forecast", "--snapshot", str(path), "--tokens", "1000"), "unknown block state")


@pytest.mark.parametrize("change, words", [
    (lambda s: s[0].update(device=1), ["several devices (0, 1)", "--device"]),
    (lambda s: s[1].update(stream=0x7F00), ["several CUDA streams"]),
    (lambda s: s[0]["blocks"][0].update(size=s[0]["blocks"][0]["size"] + 512), ["blocks add up to"]),
    (lambda s: s[2].pop("total_size"), ["no 'total_size'"]),
    (lambda s: s[2].update(segment_type="huge"), ["unknown segment_type 'huge'"]),
    (lambda s: _move(s[4], s[3]["address"]), ["overlap"]),
    (lambda s: s[4]["blocks"][1].update(address=s[4]["blocks"][1]["address"] + 512), ["must tile the segment"]),
])
def test_snapshot_contents_the_simulator_does_not_take(tmp_path, change, words):
    segments = _segments()
    change(segments)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(segments))
    assert_refused(memtel("allocsim", str(_ops_file(tmp_path)), "--from-snapshot", str(path)), *words)


def test_a_snapshot_of_several_devices_is_read_for_the_one_asked(tmp_path):
    segments = _segments()
    other = json.loads(json.dumps(segments))
    for segment in other:
        segment["device"] = 1
    path = tmp_path / "two.json"
    path.write_text(json.dumps(segments + other))
    done = memtel("forecast", "--snapshot", str(path), "--tokens", "20000", "--layers", "2", "--device", "1", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["device"] == 1


def test_private_pools_are_kept_as_reserved_memory():
    segments = _segments()
    segments[0]["segment_pool_id"] = (1, 0)  # e.g. a CUDA graph's pool
    state = read_allocator_state(segments)
    assert len(state.private_segments) == 1 and len(state.segments) == len(segments) - 1
    assert state.counters.reserved_bytes == sum(s["total_size"] for s in segments)
    assert any("private" in note for note in state.notes)


def test_limits_refuse_a_large_file_before_reading(tmp_path):
    big = tmp_path / "big.pickle"
    with open(big, "wb") as f:  # 10 GiB, sparse: nothing is written, and nothing may be read
        f.truncate(10 * 1024**3)
    started = time.perf_counter()
    assert_refused(memtel("whatif", str(big), shell=True), "10737418240 bytes", "refused before reading",
                   "--max-file-gb")
    assert time.perf_counter() - started < 30
    small = tmp_path / "small.pickle"
    small.write_bytes(RECORDED.read_bytes())
    assert_refused(memtel("whatif", str(small), "--max-file-gb", "0.00001", shell=True), "refused before reading")


def test_a_gzip_that_inflates_past_the_limit_is_refused():
    bomb = gzip.compress(b"[" + b" " * (3 * MIB) + b"]")
    with pytest.raises(SnapshotFileError, match="decompresses to more than"):
        parse_snapshot_bytes(bomb, "bomb.gz", max_bytes=MIB)


def test_special_files_and_missing_files(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert_refused(memtel("whatif", str(fifo), shell=True), "not a regular file")
    assert_refused(memtel("whatif", str(tmp_path)), "cannot read")
    assert_refused(memtel("whatif", str(tmp_path / "missing.pickle")), "cannot read")


@pytest.mark.parametrize("data, words", [
    (b"", ["empty"]),
    (b"PK\x03\x04zip", ["neither JSON nor a pickle"]),
    (b"{not json", ["not valid JSON"]),
    (b"[" * 100_000 + b"]" * 100_000, ["nested too deeply"]),
])
def test_files_that_are_no_snapshot_at_all(tmp_path, data, words):
    path = tmp_path / "x"
    path.write_bytes(data)
    with pytest.raises(SnapshotFileError) as info:
        read_snapshot_file(path)
    for word in words:
        assert word in str(info.value)


def test_bad_flags_are_refused(tmp_path):
    assert_refused(memtel("whatif", str(RECORDED), "--config", "max_split_size_mb:x"), "max_split_size_mb")
    assert_refused(memtel("whatif", str(RECORDED), "--plot", str(tmp_path / "p.svg")), "--plot writes a PNG")
    assert_refused(memtel("whatif", str(RECORDED), "--capacity-gb", "0"), "--capacity-gb")
    assert_refused(memtel("forecast", "--snapshot", str(SEEDED), "--tokens", "1000", "--alloc-conf", "bogus:1"),
                   "unrecognized CachingAllocator option 'bogus'")
    done = memtel("forecast", "--snapshot", str(SEEDED), "--tokens", "10,x")
    assert done.returncode == 2 and "positive token counts" in done.stderr


def test_errors_are_config_errors():
    with pytest.raises(SnapshotError):
        read_allocator_state({"nothing": 1})
    assert issubclass(SnapshotError, ValueError)


def test_a_recorded_simulator_history_round_trips_through_a_pickle(tmp_path):
    rec = RecordingSim("expandable_segments:True")
    handles = [rec.malloc(size) for size in (30 * MIB, 700_000, 200 * MIB)]
    rec.free(handles[1])
    rec.snapshot()
    path = tmp_path / "rec.pickle"
    path.write_bytes(pickle.dumps(rec.dump()))
    done = memtel("whatif", str(path), "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["trace"]["reproduces_segment_events"] and doc["trace"]["complete"]
    assert doc["configs"]["expandable_segments:True"]["checkpoints"][-1] == rec.counters()
