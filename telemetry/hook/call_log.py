"""The hook's per-call log (JSONL): its file name, its keys and its reader, next to its writer.

One file per process that ran a hooked call: `<log dir>/memtel-calls-rank<rank>-pid<pid>.jsonl`, one
JSON object per call with the keys of `KEYS` (telemetry/hook/line_format.py writes them; the allocator
keys are absent in a process without an allocator, `shape` is there only when asked for). A long-running
process's file is rotated into numbered segments, `...pid<pid>.0001.jsonl`, gzip-compressed to
`...pid<pid>.0001.jsonl.gz` (telemetry/hook/log_writer.py); its records continue in the next segment and
end in the unnumbered file. Readers (the A/B report, the demo's notes) use `call_log_files`,
`read_call_log` / `read_call_logs` / `read_call_columns` and the `CallRecord` they return, never a glob or
a key of their own: they read segments and the current file alike, in order.

`read_call_columns` reads the same logs column by column (8 bytes a value, no object per call): a
prefill with a tiny logits budget makes millions of hooked calls, and a report must not need gigabytes
of memory to read them.

Small and dependency-free on purpose: the hook's writer imports `log_file_name` from here.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import zlib
from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from telemetry.allocator_counters import FIELDS, AllocatorCounters
from telemetry.catalogue.fields import CALL_LOG_KEYS

FILE_PREFIX = "memtel-calls-rank"
FILE_GLOB = "memtel-calls-rank*-pid*.jsonl"  # a process's current file (segments: `call_log_files`)
_ANY_FILE_GLOB = "memtel-calls-rank*-pid*.jsonl*"
_FILE_NAME = re.compile(r"memtel-calls-rank(\d+)-pid(\d+)(?:\.(\d{4,}))?\.jsonl(\.gz)?")

# Keys of a record, in the order they are written (the catalogue's, telemetry/catalogue/fields.py).
KEYS = CALL_LOG_KEYS


def log_file_name(rank: int, pid: int) -> str:
    """The call log's file name of process `pid` at rank `rank`."""
    return f"{FILE_PREFIX}{rank}-pid{pid}.jsonl"


def segment_file_name(rank: int, pid: int, segment: int) -> str:
    """The name of segment `segment` (from 1) rotated out of process `pid`'s log (plain; `.gz` once compressed)."""
    return f"{FILE_PREFIX}{rank}-pid{pid}.{segment:04d}.jsonl"


def log_file_path(log_dir: str, rank: int, pid: int) -> str:
    return os.path.join(log_dir, log_file_name(rank, pid))


def _open_text(path: str | Path) -> TextIO:
    if str(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _lines(path: str | Path) -> Iterator[str]:
    """The lines of a log file, plain or gzip; a cut gzip stream ends the file where it was cut."""
    with _open_text(path) as lines:
        try:
            yield from lines
        except (EOFError, OSError, zlib.error):  # a truncated or corrupt segment: keep what came before
            return


@dataclass(frozen=True)
class CallRecord:
    """One hooked call: when, where, and what the allocator and the host showed right after it."""

    ts: float                        # unix seconds
    call: int                        # index of the call in its process, from 0
    site: str                        # the hooked target
    rank: int
    pid: int
    node: str
    device: str | None               # "cuda:N", "sim", or None without an allocator
    allocator: AllocatorCounters | None
    mem_available_bytes: int | None  # host MemAvailable
    swap_free_bytes: int | None
    shape: tuple[int, ...] | None    # [rows, cols] of the first tensor argument, when recorded

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CallRecord:
        """From one decoded line; KeyError/TypeError/ValueError when it is not a call record."""
        allocator = AllocatorCounters(*(int(data[name]) for name in FIELDS)) if FIELDS[0] in data else None
        shape = data.get("shape")
        return cls(ts=float(data["ts"]), call=int(data["call"]), site=str(data["site"]), rank=int(data["rank"]),
                   pid=int(data["pid"]), node=str(data.get("node", "")), device=data.get("device"),
                   allocator=allocator, mem_available_bytes=_int_or_none(data.get("mem_available_bytes")),
                   swap_free_bytes=_int_or_none(data.get("swap_free_bytes")),
                   shape=tuple(int(v) for v in shape) if isinstance(shape, list) else None)


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def iter_call_log(path: str | Path) -> Iterator[CallRecord]:
    """The records of one call log in file order; lines that are not call records are skipped.

    A log whose process was killed may end in a cut line; a full disk may leave others. Neither stops
    a reader: the records around them are still good.
    """
    for line in _lines(path):
        try:
            data = json.loads(line)
            if isinstance(data, dict):
                yield CallRecord.from_json(data)
        except (ValueError, KeyError, TypeError):
            continue


def read_call_log(path: str | Path) -> list[CallRecord]:
    return list(iter_call_log(path))


def call_log_files(log_dir: str | Path) -> list[Path]:
    """The call logs in a directory, each process's segments in order before its current file (nothing when
    the directory does not exist). A segment present both plain and compressed (a compression cut short
    after its rename) is listed once, plain."""
    directory = Path(log_dir)
    if not directory.is_dir():
        return []
    found: dict[tuple[int, int, int], Path] = {}
    for path in directory.glob(_ANY_FILE_GLOB):
        match = _FILE_NAME.fullmatch(path.name)
        if match is None:
            continue  # a compressor's temporary file, or not a call log
        rank, pid, segment, gz = int(match[1]), int(match[2]), match[3], match[4]
        order = int(segment) if segment else 1 << 62  # the current file comes last
        key = (rank, pid, order)
        if key not in found or not gz:
            found[key] = path
    return [found[key] for key in sorted(found)]


def read_call_logs(*log_dirs: str | Path) -> dict[int, list[CallRecord]]:
    """rank -> every call of that rank in these directories, sorted by time (then call index)."""
    calls: dict[int, list[CallRecord]] = {}
    for log_dir in log_dirs:
        for path in call_log_files(log_dir):
            for record in iter_call_log(path):
                calls.setdefault(record.rank, []).append(record)
    for rank_calls in calls.values():
        rank_calls.sort(key=lambda c: (c.ts, c.pid, c.call))
    return calls


NO_ALLOCATOR = -1  # the value of an allocator column for a call without an allocator


@dataclass
class CallColumns:
    """The calls of one rank, column by column, in file order (each file in call order).

    `reserved_bytes` and `num_device_alloc` are NO_ALLOCATOR (-1) for a call without an allocator.
    Calls of several processes of one rank (a server restarted) follow each other in the order their
    files' first calls do; sort by (ts, pid, call) where processes may overlap in time.
    """

    ts: array[float] = field(default_factory=lambda: array("d"))
    pid: array[int] = field(default_factory=lambda: array("q"))
    call: array[int] = field(default_factory=lambda: array("q"))
    reserved_bytes: array[int] = field(default_factory=lambda: array("q"))
    num_device_alloc: array[int] = field(default_factory=lambda: array("q"))

    def __len__(self) -> int:
        return len(self.ts)

    def extend(self, other: CallColumns) -> None:
        for name in ("ts", "pid", "call", "reserved_bytes", "num_device_alloc"):
            getattr(self, name).extend(getattr(other, name))


def read_call_columns_of(path: str | Path) -> tuple[int | None, CallColumns]:
    """One call log as columns, and its rank (None when it holds no record); skips non-records as
    `iter_call_log` does."""
    columns = CallColumns()
    ts, pid, call = columns.ts.append, columns.pid.append, columns.call.append
    reserved, device_alloc = columns.reserved_bytes.append, columns.num_device_alloc.append
    rank: int | None = None
    loads = json.loads
    for line in _lines(path):
        try:
            data = loads(line)
            values = (float(data["ts"]), int(data["pid"]), int(data["call"]), int(data["rank"]))
            allocator = (int(data["reserved_bytes"]), int(data["num_device_alloc"])) if "reserved_bytes" in data \
                else (NO_ALLOCATOR, NO_ALLOCATOR)
        except (ValueError, KeyError, TypeError):
            continue
        ts(values[0])
        pid(values[1])
        call(values[2])
        rank = values[3] if rank is None else rank
        reserved(allocator[0])
        device_alloc(allocator[1])
    return rank, columns


def read_call_columns(*log_dirs: str | Path) -> dict[int, CallColumns]:
    """rank -> the calls of every call log in these directories, as columns (see CallColumns)."""
    per_file = []
    for log_dir in log_dirs:
        for path in call_log_files(log_dir):
            rank, columns = read_call_columns_of(path)
            if rank is not None:
                per_file.append((rank, columns.ts[0], columns))
    out: dict[int, CallColumns] = {}
    for rank, _, columns in sorted(per_file, key=lambda item: (item[0], item[1])):
        if rank in out:
            out[rank].extend(columns)
        else:
            out[rank] = columns
    return out


__all__ = ["FILE_GLOB", "KEYS", "NO_ALLOCATOR", "CallColumns", "CallRecord", "call_log_files", "iter_call_log",
           "log_file_name", "log_file_path", "read_call_columns", "read_call_columns_of", "read_call_log",
           "read_call_logs", "segment_file_name"]
