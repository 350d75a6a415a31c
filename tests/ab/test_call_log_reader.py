"""The hook's call log read back through its reader (telemetry/hook/call_log.py): what the real hook
writes, real logs of earlier runs, and lines a killed process or a full disk leaves behind."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest

import telemetry
from telemetry.allocator_counters import AllocatorCounters
from telemetry.hook import set_allocator_source
from telemetry.hook.call_log import (
    FILE_GLOB,
    KEYS,
    CallRecord,
    call_log_files,
    log_file_name,
    read_call_log,
    read_call_logs,
)

FIXTURES = Path(__file__).parent / "fixtures"


def test_the_file_name_pattern():
    assert log_file_name(3, 4242) == "memtel-calls-rank3-pid4242.jsonl"
    assert Path(log_file_name(0, 1)).match(FILE_GLOB)


def test_what_the_real_hook_writes_is_read_back_as_call_records(tmp_path):
    module = types.ModuleType("memtel_reader_target")
    module.f = lambda n: n  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    counters = [AllocatorCounters(2 << 20, 1 << 20, 1, 0, 0, 0), AllocatorCounters(22 << 20, 21 << 20, 2, 0, 0, 0)]
    current = iter(counters * 3)
    set_allocator_source(lambda: next(current), device="sim")
    try:
        handle = telemetry.install([f"{module.__name__}:f"], port=None, log_dir=str(tmp_path))
        for n in range(4):
            module.f(n)
        handle.uninstall()  # flushes the log
    finally:
        set_allocator_source(None)
        sys.modules.pop(module.__name__, None)
    files = call_log_files(tmp_path)
    assert [f.name for f in files] == [log_file_name(0, os.getpid())]
    calls = read_call_logs(tmp_path)[0]
    assert [c.call for c in calls] == [0, 1, 2, 3]
    assert all(c.site == f"{module.__name__}:f" and c.device == "sim" and c.rank == 0 for c in calls)
    assert all(c.allocator in counters for c in calls)
    assert all(c.mem_available_bytes and c.mem_available_bytes > 0 for c in calls)
    assert set(json.loads(files[0].read_text().splitlines()[0])) <= set(KEYS)


def test_a_real_log_without_an_allocator():
    log = next((FIXTURES / "cpu-vllm-repeats" / "hook-logs" / "stock").glob(FILE_GLOB))
    calls = read_call_log(log)
    assert len(calls) == len(log.read_text().splitlines()) > 0
    assert all(c.allocator is None and c.device == "cpu" for c in calls)
    assert calls == sorted(calls, key=lambda c: c.call)


def test_lines_that_are_not_records_are_skipped(tmp_path):
    good = {"ts": 1.5, "call": 0, "site": "m:f", "rank": 1, "pid": 7, "node": "n", "device": "cuda:0",
            "reserved_bytes": 4, "allocated_bytes": 3, "num_device_alloc": 1, "num_device_free": 0,
            "num_alloc_retries": 0, "num_ooms": 0, "mem_available_bytes": None, "swap_free_bytes": 9,
            "shape": [8, 16]}
    later = dict(good, call=1, ts=2.5)
    path = tmp_path / log_file_name(1, 7)
    path.write_text(json.dumps(good) + "\n" + "\x00\x00garbage\n" + json.dumps({"call": 5}) + "\n"
                    + json.dumps(later) + "\n" + json.dumps(later)[:30])  # a full disk, a partial line
    calls = read_call_log(path)
    assert calls == [CallRecord(1.5, 0, "m:f", 1, 7, "n", "cuda:0", AllocatorCounters(4, 3, 1, 0, 0, 0), None, 9,
                                (8, 16)),
                     CallRecord(2.5, 1, "m:f", 1, 7, "n", "cuda:0", AllocatorCounters(4, 3, 1, 0, 0, 0), None, 9,
                                (8, 16))]
    assert read_call_logs(tmp_path / "missing") == {}


@pytest.mark.parametrize("name", ["memtel-calls-rank0-pid1.json", "calls-rank0-pid1.jsonl"])
def test_other_files_in_the_directory_are_not_call_logs(tmp_path, name):
    (tmp_path / name).write_text("{}\n")
    assert call_log_files(tmp_path) == []


def test_columns_hold_the_same_calls_as_records(tmp_path):
    from telemetry.hook.call_log import NO_ALLOCATOR, read_call_columns

    lines = []
    for pid, first_ts in ((11, 1.0), (12, 10.0)):  # a server restarted: two processes of rank 0
        for call in range(3):
            record = {"ts": first_ts + call, "call": call, "site": "m:f", "rank": 0, "pid": pid, "node": "n",
                      "device": "sim", "mem_available_bytes": 5, "swap_free_bytes": 0}
            if pid == 12:
                record.update(reserved_bytes=call << 20, allocated_bytes=0, num_device_alloc=call, num_device_free=0,
                              num_alloc_retries=0, num_ooms=0)
            lines.append((pid, json.dumps(record)))
    for pid in (12, 11):
        (tmp_path / log_file_name(0, pid)).write_text("".join(line + "\n" for p, line in lines if p == pid) + "{cut")
    columns = read_call_columns(tmp_path)[0]
    assert list(columns.ts) == [1.0, 2.0, 3.0, 10.0, 11.0, 12.0]  # files in the order of their first call
    assert list(columns.pid) == [11, 11, 11, 12, 12, 12]
    assert list(columns.reserved_bytes) == [NO_ALLOCATOR] * 3 + [0, 1 << 20, 2 << 20]
    assert list(columns.num_device_alloc) == [NO_ALLOCATOR] * 3 + [0, 1, 2]
    records = read_call_logs(tmp_path)[0]
    assert [r.ts for r in records] == list(columns.ts)
