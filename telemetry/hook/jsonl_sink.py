"""The per-call JSONL log: one file per process, written by a background thread.

The hot path formats its record into one line (a `%` template per site, built once) and appends
the string to a bounded deque: no lock, no I/O, no json module. A writer thread joins the waiting
lines and writes them when `flush_records` are waiting or every `flush_interval_s`, and at exit.
When the deque is full the record is dropped and counted, so a stalled disk never blocks the
serving thread. File: `<log_dir>/memtel-calls-rank<rank>-pid<pid>.jsonl` (format in
docs/architecture.md).

Why format on the hot path: the writer thread shares the GIL with the serving thread, so the
formatting costs the serving thread the same time on either thread; done here it needs no
intermediate record tuple, and a queued string is not tracked by the garbage collector (a queue of
tuples is: thousands of them alive between flushes made collections more frequent and slower).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from telemetry.hook.allocator import FIELDS

log = logging.getLogger("memtel.hook")

NS_PER_S = 1_000_000_000
WRITE_CHUNK_LINES = 128   # lines joined per write (~300 bytes each)


@dataclass(frozen=True)
class JsonlConfig:
    log_dir: str
    max_queue: int = 65536          # records waiting for the writer, at most (~300 bytes each)
    flush_records: int = 4096       # wake the writer when this many wait (fewer GIL hand-overs)
    flush_interval_s: float = 0.5   # and at least this often


def log_path(log_dir: str, rank: int, pid: int) -> str:
    return os.path.join(log_dir, f"memtel-calls-rank{rank}-pid{pid}.jsonl")


# A record: (ts, call, site, device, allocator values or None, mem_available, swap_free, shape);
# ts in unix seconds (float) here, in integer nanoseconds on the hot path.
def format_record(item: tuple, rank: int, pid: int, node: str) -> str:
    """The record as one JSON line, without the newline (the reference formatter)."""
    ts, call, site, device, allocator, available, swap_free, shape = item
    record = {"ts": ts, "call": call, "site": site, "rank": rank, "pid": pid, "node": node, "device": device}
    if allocator is not None:
        record.update(zip(FIELDS, allocator))
    record["mem_available_bytes"] = available
    record["swap_free_bytes"] = swap_free
    if shape is not None:
        record["shape"] = shape
    return json.dumps(record, separators=(",", ":"))


# A line is a per-site head (ts, call and the fixed site/rank/pid/node/device, JSON-escaped once),
# then the allocator part, then the memory part, which closes the object.
ALLOCATOR_PART = "".join(f',"{name}":%d' for name in FIELDS)
MEMORY_PART = ',"mem_available_bytes":%d,"swap_free_bytes":%d}\n'


class SiteLine:
    """One site's line parts: the head template and the last allocator and memory parts.

    Consecutive records of a site mostly repeat the allocator values (they change when a tensor
    or a segment comes or goes) and often the host values, so the last part is kept with the values
    it shows and reused while they are equal. Each cached part is one tuple, replaced whole: two
    threads recording the same site can never pair one record's values with another's text.
    """

    __slots__ = ("allocator", "device", "head", "memory", "with_allocator")

    def __init__(self, device: str, with_allocator: bool, head: str) -> None:
        self.device = device
        self.with_allocator = with_allocator
        self.head = head                    # % (seconds, fraction, call, allocator part, memory part)
        self.allocator: tuple = (None, "")   # (allocator values, their part)
        self.memory: tuple = (None, None, "")  # (mem_available, swap_free, their part)


class RecordFormatter:
    """Formats records as format_record does, from per-site templates (JsonlSink.push inlines
    the common case).

    `ts` is written from integer nanoseconds as `<seconds>.<9 digits>`: a JSON float, like
    format_record's, without the float-to-shortest-string conversion that cost a third of a line.
    """

    def __init__(self, rank: int, pid: int, node: str) -> None:
        self.rank, self.pid, self.node = rank, pid, node

    def site_line(self, site: str, device: str, with_allocator: bool) -> SiteLine:
        head = json.dumps({"site": site, "rank": self.rank, "pid": self.pid, "node": self.node,
                           "device": device}, separators=(",", ":"))[1:-1].replace("%", "%%")
        return SiteLine(device, with_allocator, f'{{"ts":%d.%09d,"call":%d,{head}%s%s')

    def __call__(self, ts_ns: int, call: int, site: str, device: str, allocator: tuple | None,
                 available: int | None, swap_free: int | None, shape: list | None,
                 line: SiteLine | None = None) -> str:
        """One line, newline included (`line`: the site's parts, if the caller has them)."""
        if available is None or swap_free is None:  # rare: the reference path
            item = (ts_ns / NS_PER_S, call, site, device, allocator, available, swap_free, shape)
            return format_record(item, self.rank, self.pid, self.node) + "\n"
        if line is None:
            line = self.site_line(site, device, allocator is not None)
        seconds, fraction = divmod(ts_ns, NS_PER_S)
        text = line.head % (seconds, fraction, call, "" if allocator is None else ALLOCATOR_PART % tuple(allocator),
                            MEMORY_PART % (available, swap_free))
        if shape is not None:  # opt-in: the last field
            text = f'{text[:-2]},"shape":{json.dumps(shape, separators=(",", ":"))}}}\n'
        return text


class JsonlSink:
    def __init__(self, config: JsonlConfig, node: str, on_error: Callable[[str], None] = lambda stage: None) -> None:
        self.config = config
        self.node = node
        self.on_error = on_error  # counts a failed write in memtel_hook_errors_total
        self._max_queue = config.max_queue
        self._flush_records = config.flush_records
        self._reset_process_state()

    def _reset_process_state(self) -> None:
        """What belongs to one process: a forked child starts again from here."""
        self.dropped = 0
        self.written = 0
        self._drop_lock = threading.Lock()
        self._queue: collections.deque = collections.deque()   # formatted lines
        self._early: list = []   # records pushed before open() (another thread's first call): formatted at flush
        self._wake = threading.Event()
        self._stop = False
        self._io_lock = threading.RLock()  # re-entrant: a SIGTERM flush may interrupt a flush
        self._thread: threading.Thread | None = None
        self._file = None
        self._rank: int | None = None
        self._format: RecordFormatter | None = None
        self._lines: dict = {}   # site -> SiteLine, once open
        self._pid = os.getpid()
        self.path: str | None = None

    def open(self, rank: int) -> None:
        """Name the file and start the writer: called once, at the first record (rank known)."""
        self._rank = rank
        self._pid = os.getpid()
        self.path = log_path(self.config.log_dir, rank, self._pid)
        self._format = RecordFormatter(rank, self._pid, self.node)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="memtel-jsonl-writer", daemon=True)
        self._thread.start()

    # hot path
    def push(self, ts_ns: int, call: int, site: str, device: str, allocator: tuple | None,
             available: int | None, swap_free: int | None, shape: list | None = None) -> None:
        """Format the record into its line and queue it: RecordFormatter's common case, inlined (a
        Python call less per record), with the site's last allocator and memory parts reused while
        their values repeat (SiteLine)."""
        queue = self._queue
        if len(queue) >= self._max_queue:
            with self._drop_lock:
                self.dropped += 1
            return
        line = self._lines.get(site)
        if (line is None or line.device != device or line.with_allocator is (allocator is None)
                or shape is not None or available is None or swap_free is None):
            self._push_slow(ts_ns, call, site, device, allocator, available, swap_free, shape)
            return
        seconds, fraction = divmod(ts_ns, NS_PER_S)
        part = line.allocator
        if part[0] != allocator:
            part = line.allocator = (allocator, ALLOCATOR_PART % allocator)
        memory = line.memory
        if memory[0] != available or memory[1] != swap_free:
            memory = line.memory = (available, swap_free, MEMORY_PART % (available, swap_free))
        queue.append(line.head % (seconds, fraction, call, part[1], memory[2]))
        if len(queue) >= self._flush_records and not self._wake.is_set():
            self._wake.set()

    def _push_slow(self, ts_ns: int, call: int, site: str, device: str, allocator: tuple | None,
                   available: int | None, swap_free: int | None, shape: list | None) -> None:
        format = self._format
        if format is None:  # another thread's record while the first one opens the log
            self._early.append((ts_ns, call, site, device, allocator, available, swap_free, shape))
            return
        # The site's line parts, made once and reused by every record of the site (a record with a
        # shape or an absent host value too); replaced if its device or allocator presence changes.
        line = self._lines.get(site)
        if line is None or line.device != device or line.with_allocator is (allocator is None):
            line = self._lines[site] = format.site_line(site, device, allocator is not None)
        self._queue.append(format(ts_ns, call, site, device, allocator, available, swap_free, shape, line))
        if len(self._queue) >= self._flush_records:
            self._wake.set()

    # writer side
    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self.config.flush_interval_s)
            self._wake.clear()
            try:
                self.flush()
            except Exception:  # a full disk must not kill the writer: count it and keep going
                log.warning("memtel: writing %s failed", self.path, exc_info=True)
                self.on_error("jsonl")

    def flush(self) -> None:
        """Write every waiting record now (writer thread, exit, SIGTERM)."""
        format = self._format
        if format is None:
            return
        with self._io_lock:
            early = self._early   # never swapped: a late append stays for the next flush
            lines = [format(*early.pop(0)) for _ in range(len(early))]
            queue = self._queue
            popleft = queue.popleft
            # Only what is queued now: the hot path appends concurrently, on the right.
            lines += [popleft() for _ in range(len(queue))]
            if not lines:
                return
            try:
                if self._file is None:
                    os.makedirs(self.config.log_dir, exist_ok=True)
                    self._file = open(self.path, "a", encoding="utf-8")
                write = self._file.write
                # In chunks of ~40 kB: one join of everything (MBs) costs 3x as much, page faults
                # on a fresh buffer each time (BENCHMARKS.md, "Hook overhead").
                for start in range(0, len(lines), WRITE_CHUNK_LINES):
                    write("".join(lines[start:start + WRITE_CHUNK_LINES]))
                self._file.flush()
            except Exception:
                with self._drop_lock:
                    self.dropped += len(lines)
                raise
            self.written += len(lines)

    def close(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and thread.is_alive():
            thread.join(timeout)
        try:
            self.flush()
        finally:
            with self._io_lock:
                if self._file is not None:
                    self._file.close()
                    self._file = None

    def reset_after_fork(self) -> None:
        """In a forked child: the parent's queue, file and thread are not ours."""
        self._reset_process_state()
