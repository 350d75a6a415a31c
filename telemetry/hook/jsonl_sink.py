"""The per-call JSONL log: one file per process, written by a background thread.

The hot path appends a tuple to a bounded deque (no lock, no I/O, no JSON). A writer thread turns
the tuples into JSON lines and writes them when `flush_records` are waiting or every
`flush_interval_s`, and at exit. When the deque is full the record is dropped and counted, so a
stalled disk never blocks the serving thread. File: `<log_dir>/memtel-calls-rank<rank>-pid<pid>.jsonl`
(format in docs/architecture.md).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, Optional

from telemetry.hook.allocator import FIELDS

log = logging.getLogger("memtel.hook")


@dataclass(frozen=True)
class JsonlConfig:
    log_dir: str
    max_queue: int = 65536          # records waiting for the writer, at most (~200 bytes each)
    flush_records: int = 4096       # wake the writer when this many wait (fewer GIL hand-overs)
    flush_interval_s: float = 0.5   # and at least this often


def log_path(log_dir: str, rank: int, pid: int) -> str:
    return os.path.join(log_dir, f"memtel-calls-rank{rank}-pid{pid}.jsonl")


# A queued record: (ts, call, site, device, allocator values or None, mem_available, swap_free, shape)
def format_record(item: tuple, rank: int, pid: int, node: str) -> str:
    """The record as one JSON line (the reference formatter; RecordFormatter is the fast one)."""
    ts, call, site, device, allocator, available, swap_free, shape = item
    record = {"ts": ts, "call": call, "site": site, "rank": rank, "pid": pid, "node": node, "device": device}
    if allocator is not None:
        record.update(zip(FIELDS, allocator))
    record["mem_available_bytes"] = available
    record["swap_free_bytes"] = swap_free
    if shape is not None:
        record["shape"] = shape
    return json.dumps(record, separators=(",", ":"))


class RecordFormatter:
    """Formats records as format_record does, five times faster: the writer shares the GIL with the
    serving thread, so its cost per record counts too. The per-site part is escaped once."""

    def __init__(self, rank: int, pid: int, node: str) -> None:
        self.rank, self.pid, self.node = rank, pid, node
        self._heads: dict = {}

    def __call__(self, item: tuple) -> str:
        ts, call, site, device, a, available, swap_free, shape = item
        if available is None or swap_free is None or type(ts) is not float:
            return format_record(item, self.rank, self.pid, self.node)
        head = self._heads.get((site, device))
        if head is None:
            head = self._heads[(site, device)] = json.dumps(
                {"site": site, "rank": self.rank, "pid": self.pid, "node": self.node, "device": device},
                separators=(",", ":"))[1:-1]
        tail = "}" if shape is None else f',"shape":{json.dumps(shape)}}}'
        if a is None:
            return (f'{{"ts":{ts!r},"call":{call},{head},"mem_available_bytes":{available},'
                    f'"swap_free_bytes":{swap_free}{tail}')
        return (f'{{"ts":{ts!r},"call":{call},{head},"reserved_bytes":{a[0]},"allocated_bytes":{a[1]},'
                f'"num_device_alloc":{a[2]},"num_device_free":{a[3]},"num_alloc_retries":{a[4]},'
                f'"num_ooms":{a[5]},"mem_available_bytes":{available},"swap_free_bytes":{swap_free}{tail}')


class JsonlSink:
    def __init__(self, config: JsonlConfig, node: str, on_error: Callable[[str], None] = lambda stage: None) -> None:
        self.config = config
        self.node = node
        self.on_error = on_error  # counts a failed write in memtel_hook_errors_total
        self.dropped = 0
        self._drop_lock = threading.Lock()
        self.written = 0
        self._queue: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stop = False
        self._io_lock = threading.RLock()  # re-entrant: a SIGTERM flush may interrupt a flush
        self._thread: Optional[threading.Thread] = None
        self._file = None
        self._rank: Optional[int] = None
        self._pid = os.getpid()
        self.path: Optional[str] = None

    def open(self, rank: int) -> None:
        """Name the file and start the writer: called once, at the first record (rank known)."""
        self._rank = rank
        self._pid = os.getpid()
        self._format = RecordFormatter(rank, self._pid, self.node)
        self.path = log_path(self.config.log_dir, rank, self._pid)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="memtel-jsonl-writer", daemon=True)
        self._thread.start()

    # hot path
    def push(self, item: tuple) -> None:
        queue = self._queue
        if len(queue) >= self.config.max_queue:
            with self._drop_lock:
                self.dropped += 1
            return
        queue.append(item)
        if len(queue) >= self.config.flush_records and not self._wake.is_set():
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
        if self._rank is None:
            return
        with self._io_lock:
            lines = []
            queue = self._queue
            format = self._format
            while True:
                try:
                    item = queue.popleft()
                except IndexError:
                    break
                lines.append(format(item))
            if not lines:
                return
            try:
                if self._file is None:
                    os.makedirs(self.config.log_dir, exist_ok=True)
                    self._file = open(self.path, "a", encoding="utf-8")
                self._file.write("\n".join(lines) + "\n")
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
        self._queue = collections.deque()
        self._wake = threading.Event()
        self._io_lock = threading.RLock()
        self._drop_lock = threading.Lock()
        self._thread = None
        self._file = None
        self._rank = None
        self.path = None
        self.dropped = 0
        self.written = 0
