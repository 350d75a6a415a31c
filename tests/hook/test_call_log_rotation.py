"""The hook's call log at ~10^5 calls per request: rotated into numbered segments, compressed off the hot path,
and read back whole, in order, by the reader (telemetry/hook/call_log.py). Nothing is lost when compressing
fails or is cut short."""

from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path

from telemetry.allocator_counters import AllocatorCounters
from telemetry.hook import log_writer
from telemetry.hook.call_log import (
    call_log_files,
    log_file_name,
    read_call_columns,
    read_call_log,
    read_call_logs,
    segment_file_name,
)
from telemetry.hook.log_writer import CallLogWriter
from telemetry.hook.state import HookState


def open_writer(directory: Path, **options) -> CallLogWriter:
    state = HookState(node="node-1", targets={}, log_configured=True)
    writer = CallLogWriter(str(directory), state, **{"max_queue": 1 << 20, "flush_records": 4096,
                                                     "flush_interval_s": 0.05, **options})
    assert writer.open(rank=0)
    return writer


def push(writer: CallLogWriter, calls: int, start: int = 0, flush_every: int = 5000) -> None:
    for i in range(start, start + calls):
        writer.push(time.time_ns(), i, "m:f", "sim", AllocatorCounters(i << 20, i, i, 0, 0, 0), 1 << 30, 0)
        if i % flush_every == flush_every - 1:
            writer.flush()  # rotation happens at a write, as the writer thread's would


def test_a_long_log_is_rotated_compressed_and_read_back_whole(tmp_path):
    calls = 15_000  # ~230 bytes a line: ~3.5 MB, rotated every 512 KiB (at a write: every second flush)
    rotate = 512 << 10
    writer = open_writer(tmp_path, rotate_bytes=rotate)
    push(writer, calls, flush_every=1250)
    writer.close()
    pid = os.getpid()
    names = [p.name for p in call_log_files(tmp_path)]
    segments = [n for n in names if n != log_file_name(0, pid)]
    assert len(segments) >= 5 and names[-1] == log_file_name(0, pid)
    assert all(n.endswith(".jsonl.gz") for n in segments), names  # every rotated segment compressed
    assert segments == [segment_file_name(0, pid, i + 1) + ".gz" for i in range(len(segments))]
    # Nothing plain is left but the current file, and it is below the rotation size.
    plain = [p for p in tmp_path.iterdir() if p.name.endswith(".jsonl")]
    assert [p.name for p in plain] == [log_file_name(0, pid)] and plain[0].stat().st_size < rotate
    raw = sum(len(gzip.decompress(p.read_bytes())) for p in tmp_path.glob("*.gz")) + plain[0].stat().st_size
    compressed = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert compressed < raw / 5  # bounded disk: the segments compress well (~28x on the lab's logs)
    # Every call once, in order, by every reader.
    records = read_call_logs(tmp_path)[0]
    assert [r.call for r in records] == list(range(calls))
    assert records[-1].allocator == AllocatorCounters((calls - 1) << 20, calls - 1, calls - 1, 0, 0, 0)
    columns = read_call_columns(tmp_path)[0]
    assert list(columns.call) == list(range(calls)) and list(columns.reserved_bytes)[-1] == (calls - 1) << 20
    assert writer.written == calls


def test_a_segment_that_cannot_be_compressed_stays_plain_and_is_read(tmp_path):
    pid = os.getpid()
    # The compressor's temporary file is already there (O_EXCL): compressing segment 1 fails.
    blocker = tmp_path / (segment_file_name(0, pid, 1) + ".gz.tmp")
    tmp_path.chmod(0o700)
    blocker.write_text("not ours")
    writer = open_writer(tmp_path, rotate_bytes=1 << 20)
    push(writer, 20_000)
    writer.close()
    assert (tmp_path / segment_file_name(0, pid, 1)).exists()  # left plain: nothing lost
    assert (tmp_path / (segment_file_name(0, pid, 2) + ".gz")).exists()  # the others compressed
    assert blocker.read_text() == "not ours"  # a file the compressor did not create is never removed
    assert [r.call for r in read_call_logs(tmp_path)[0]] == list(range(20_000))


def test_reader_counts_a_segment_once_and_survives_a_cut_one(tmp_path):
    pid = 4242
    lines = [json.dumps({"ts": 100.0 + i, "call": i, "site": "s", "rank": 1, "pid": pid, "node": "n",
                         "device": "sim", "reserved_bytes": i, "allocated_bytes": 0, "num_device_alloc": 0,
                         "num_device_free": 0, "num_alloc_retries": 0, "num_ooms": 0, "mem_available_bytes": 1,
                         "swap_free_bytes": 0}) + "\n" for i in range(300)]
    first, second, current = "".join(lines[:100]), "".join(lines[100:200]), "".join(lines[200:])
    # Segment 1 both plain and compressed (a compressor killed after its rename, before the unlink).
    (tmp_path / segment_file_name(1, pid, 1)).write_text(first)
    (tmp_path / (segment_file_name(1, pid, 1) + ".gz")).write_bytes(gzip.compress(first.encode()))
    # Segment 2 compressed, but cut in the middle of its stream.
    whole = gzip.compress(second.encode())
    (tmp_path / (segment_file_name(1, pid, 2) + ".gz")).write_bytes(whole[: len(whole) // 2])
    (tmp_path / log_file_name(1, pid)).write_text(current)
    (tmp_path / (segment_file_name(1, pid, 3) + ".gz.tmp")).write_bytes(b"\x1f\x8b partial")  # ignored
    files = [p.name for p in call_log_files(tmp_path)]
    assert files == [segment_file_name(1, pid, 1), segment_file_name(1, pid, 2) + ".gz", log_file_name(1, pid)]
    calls = [r.call for r in read_call_logs(tmp_path)[1]]
    assert calls[:100] == list(range(100)) and calls[-100:] == list(range(200, 300))
    assert 100 < len(calls) < 300 and calls == sorted(set(calls))  # the cut segment's readable part, once
    assert [r.call for r in read_call_log(tmp_path / log_file_name(1, pid))] == list(range(200, 300))


def test_the_default_rotation_size_is_the_modules(tmp_path, monkeypatch):
    monkeypatch.setattr(log_writer, "ROTATE_BYTES", 1 << 20)
    writer = open_writer(tmp_path)
    push(writer, 6_000)
    writer.close()
    assert len(call_log_files(tmp_path)) >= 2
    never = open_writer(tmp_path / "never", rotate_bytes=None)
    push(never, 6_000)
    never.close()
    assert len(call_log_files(tmp_path / "never")) == 1
