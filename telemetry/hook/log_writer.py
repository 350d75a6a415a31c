"""The per-call JSONL log of one process: a bounded queue on the hot path, a writer thread for the I/O.

The hot path formats its record into one line (line_format.SiteLine, written out in `push`) and appends
it to a deque: no lock, no I/O. The writer thread joins the waiting lines and writes them when `flush_records` wait,
every `flush_interval_s`, and at exit. A full queue drops the record and counts it, so a stalled disk
never blocks the serving thread.

The file is opened the way every memtel file is (telemetry/safefs.py): in a directory this user owns
and no one else can write (created 0700 if missing), `O_NOFOLLOW`, mode 0600. An unsafe directory or
a file that cannot be opened is one log line and no log; the hook goes on without it.

A failing disk never reaches the host: a write that fails (ENOSPC, EIO) drops the records that did not
reach the file whole, counts them (`memtel_hook_log_dropped_records_total{reason="write_failed"}`), cuts
a partly written line back off the file (no torn lines), logs at most one line a minute and never
raises, not even from `flush()`. Writing resumes when the disk has room again.

Why format on the hot path: the writer thread shares the GIL with the serving thread, so formatting
costs the serving thread the same time on either thread; done here it needs no intermediate record,
and a queued string is not tracked by the garbage collector (a queue of tuples is).

Bounded disk: a 1M-token prefill makes ~10^5 hooked calls per rank (~300 bytes a line). When the file
reaches `rotate_bytes` (ROTATE_BYTES, 32 MiB) after a write, the writer renames it to a numbered segment
(`...pid<pid>.0001.jsonl`), opens a new file under the usual name and hands the segment to a compressor
thread (gzip level 1: about 1/28 of the size on the lab's logs, ~0.2 s per 57 MB here; zlib releases the GIL,
and the hot path never waits for it). The compressed segment is written to a temporary name, fsynced,
renamed to `.0001.jsonl.gz`, then the plain segment is removed: a kill at any point leaves the records
whole in one of the two, and the reader (call_log.py) reads segments, compressed or not, in order.
"""

from __future__ import annotations

import collections
import errno
import logging
import math
import os
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

from telemetry import hook_env
from telemetry.allocator_counters import AllocatorCounters
from telemetry.catalogue import metrics as catalogue
from telemetry.hook.call_log import log_file_name, segment_file_name  # file names, beside the log's reader
from telemetry.hook.line_format import NS_PER_S, SiteLine
from telemetry.hook.state import QUEUE_FULL, WRITE_FAILED, HookState
from telemetry.safefs import UnsafePathError, create_private, ensure_private_dir, fsync_dir, open_private, write_all

log = logging.getLogger("memtel.hook")

WRITE_CHUNK_LINES = 128        # lines joined per write (~300 bytes each)
WARNING_INTERVAL_S = 60.0      # at most one "write failed" log line per this many seconds
ROTATE_BYTES = 32 << 20        # a file this large becomes a numbered segment, compressed off the hot path
COMPRESS_LEVEL = 1             # gzip level of rotated segments: fast, and JSONL lines compress ~28x anyway
COMPRESS_CHUNK_BYTES = 1 << 20
DEFAULT = object()             # rotate_bytes not given


class CallLogWriter:
    """The call log of this process: `push` on the hot path, `flush` from the writer thread."""

    def __init__(self, directory: str, state: HookState, *, max_queue: int, flush_records: int,
                 flush_interval_s: float, rotate_bytes: int | object | None = DEFAULT,
                 compress: bool = True) -> None:
        self.directory = directory
        self.state = state
        self._max_queue = max_queue
        self._flush_records = flush_records
        self._flush_interval_s = flush_interval_s
        # None: never rotate; DEFAULT: this module's ROTATE_BYTES when the writer is made.
        limit = ROTATE_BYTES if rotate_bytes is DEFAULT else rotate_bytes
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ValueError(f"rotate_bytes must be a positive integer or None, got {rotate_bytes!r}")
        self._rotate_bytes: int | None = limit
        self._compress = compress
        self._reset_process_state()

    def _reset_process_state(self) -> None:
        """What belongs to one process: a forked child starts again from here."""
        self.written = 0      # records that reached the file whole
        self._queue: collections.deque[str] = collections.deque()
        self._early: list[tuple[Any, ...]] = []   # records pushed before open() finished (another thread's first call)
        self._wake = threading.Event()
        self._stop = False
        self._io_lock = threading.RLock()  # re-entrant: a SIGTERM flush may interrupt a flush
        self._flushing: int | None = None   # the thread inside flush() now: its taken lines are not written yet
        self._after_flush: Callable[[], Any] | None = None   # a signal's action, held until that flush ends
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        self._size = 0        # bytes of whole lines in the file: where a torn line is cut back to
        self._torn = False    # a partial line could not be cut off yet: nothing is written before it is
        self._lines: dict[str, SiteLine] = {}
        self._rank: int | None = None
        self._pid = os.getpid()
        self.path: str | None = None
        self._last_warning = -math.inf
        self._unreported = 0  # records dropped since the last warning line
        self._segments = 0    # segments rotated out of this process's file so far
        self._compressors: list[threading.Thread] = []

    def open(self, rank: int) -> bool:
        """Create the file and start the writer (once per process, when it starts recording).

        False, with one log line and `memtel_hook_errors_total{stage="log_open"}`, where the directory is
        unsafe or the file cannot be opened: the hook then runs without a log.
        """
        pid = os.getpid()
        path = os.path.join(self.directory, log_file_name(rank, pid))
        try:
            ensure_private_dir(self.directory, what=f"call log directory ({hook_env.LOG_DIR})")
            fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        except UnsafePathError as error:
            return self._refuse(str(error))
        except OSError as error:
            why = ("it is a symbolic link; expected a regular file or none" if error.errno == errno.ELOOP
                   else error.strerror or str(error))
            return self._refuse(f"cannot open {path}: {why}")
        try:
            self._size = os.fstat(fd).st_size
        except OSError:
            os.close(fd)
            return self._refuse(f"cannot read the size of {path}")
        self._fd, self.path, self._rank, self._pid = fd, path, rank, pid
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="memtel-call-log-writer", daemon=True)
        self._thread.start()
        return True

    def _refuse(self, why: str) -> bool:
        log.error("memtel: call log off in pid %d: %s; the hook goes on without it", os.getpid(), why)
        self.state.count_error("", "log_open")
        return False

    # hot path
    def push(self, ts_ns: int, call: int, site: str, device: str, allocator: AllocatorCounters | None,
             available: int | None, swap_free: int | None, shape: list[int] | None = None) -> None:
        queue = self._queue
        if len(queue) >= self._max_queue:
            self.state.count_log_dropped(QUEUE_FULL, 1)
            return
        line = self._lines.get(site)
        if line is None or line.device != device:
            if self._rank is None:  # another thread's record while the first one opens the log
                self._early.append((ts_ns, call, site, device, allocator, available, swap_free, shape))
                return
            line = self._lines[site] = SiteLine(site, device, self._rank, self._pid, self.state.node)
        if shape is None:   # line.format(...) written out: a Python call less per record
            second = line.second
            fraction = ts_ns - second[0]
            if fraction >= NS_PER_S or fraction < 0:
                second = line.new_second(ts_ns)
                fraction = ts_ns - second[0]
            tail = line.tail
            if tail[0] is not allocator or tail[1] != available or tail[2] != swap_free:
                tail = line.new_tail(allocator, available, swap_free)
            queue.append(f'{second[1]}{str(fraction + NS_PER_S)[1:]},"call":{call}{tail[3]}}}\n')
        else:
            queue.append(line.format(ts_ns, call, allocator, available, swap_free, shape))
        if len(queue) >= self._flush_records and not self._wake.is_set():
            self._wake.set()

    # writer side
    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self._flush_interval_s)
            self._wake.clear()
            self.flush()

    def flush(self) -> None:
        """Write every waiting record now (writer thread, exit, SIGTERM, `handle.flush()`). Never raises
        itself; a signal's action held by `flush_then` runs at its end, and may raise as it would have."""
        after: Callable[[], Any] | None = None
        try:
            with self._io_lock:
                self._flushing = threading.get_ident()
                try:
                    lines = self._take()
                    if lines:
                        self._write(lines)
                finally:
                    self._flushing = None
                    # taken under the lock: only the thread it was held for (the one flushing) runs it
                    after, self._after_flush = self._after_flush, None
        except Exception as error:  # a bug or an odd file system: never into the host
            self.state.count_error("", "log_write")
            self._warn(f"writing failed unexpectedly ({error!r})", 0)
        if after is not None:
            after()

    def flush_then(self, action: Callable[[], Any]) -> Any:
        """Flush, then `action` (a signal handler's: end the process). A signal handler runs on the main
        thread between two bytecodes, which can be inside a flush of that same thread (a multiprocessing
        child's exit flush when the pool's terminate() sends SIGTERM): the lines that flush has taken are
        in its hands only. Flushing again and ending the process there would lose them, so the action is
        held and that flush runs it once its lines are written."""
        if self._flushing == threading.get_ident():
            self._after_flush = action
            return None
        self.flush()
        return action()

    def _take(self) -> list[str]:
        if self._rank is None:
            return []
        lines = []
        early = self._early   # never swapped: a late append stays for the next flush
        for _ in range(len(early)):
            ts_ns, call, site, device, allocator, available, swap_free, shape = early.pop(0)
            line = self._lines.get(site)
            if line is None or line.device != device:
                line = self._lines[site] = SiteLine(site, device, self._rank, self._pid, self.state.node)
            lines.append(line.format(ts_ns, call, allocator, available, swap_free, shape))
        queue = self._queue
        popleft = queue.popleft
        # Only what is queued now: the hot path appends concurrently, on the right.
        lines += [popleft() for _ in range(len(queue))]
        return lines

    def _write(self, lines: list[str]) -> None:
        fd = self._fd
        if fd is None or (self._torn and not self._cut_back(fd)):
            self._dropped(len(lines), "the file is closed" if fd is None else "a torn line could not be cut off")
            return
        written = 0
        # In chunks of ~40 kB: one join of everything (MBs) costs 3x as much, page faults on a fresh
        # buffer each time (BENCHMARKS.md, "Hook overhead").
        for start in range(0, len(lines), WRITE_CHUNK_LINES):
            chunk = lines[start:start + WRITE_CHUNK_LINES]
            data = "".join(chunk).encode()
            done, error = _write_some(fd, data)
            if error is None:
                self._size += done
                written += len(chunk)
                continue
            # Keep the whole lines that reached the file; cut a partial one back off.
            whole = data.rfind(b"\n", 0, done) + 1
            written += data.count(b"\n", 0, whole)
            self._size += whole
            if whole < done:
                self._torn = True
                self._cut_back(fd)
            self.written += written
            self._dropped(len(lines) - written, error.strerror or str(error))
            return
        self.written += written
        if self._rotate_bytes is not None and self._size >= self._rotate_bytes:
            self._rotate()

    def _rotate(self) -> None:
        """The full file becomes the next numbered segment; a new file takes its name (under the I/O lock)."""
        path, fd = self.path, self._fd
        if path is None or fd is None or self._rank is None:
            return
        segment = os.path.join(self.directory, segment_file_name(self._rank, self._pid, self._segments + 1))
        try:
            os.rename(path, segment)
        except OSError as error:  # keep writing to the one file: nothing is lost, only the bound
            self._warn(f"rotation failed ({error.strerror or error}); the file keeps growing", 0)
            return
        try:
            new_fd = create_private(path, os.O_WRONLY | os.O_APPEND)
        except OSError as error:
            os.rename(segment, path)  # back to one growing file rather than no log at all
            self._warn(f"rotation failed ({error.strerror or error}); the file keeps growing", 0)
            return
        self._segments += 1
        self._fd, self._size = new_fd, 0
        try:
            os.close(fd)
        except OSError:
            pass
        if self._compress:
            thread = threading.Thread(target=_compress_segment, args=(segment, self._warn),
                                      name="memtel-call-log-compress", daemon=True)
            self._compressors = [t for t in self._compressors if t.is_alive()] + [thread]
            thread.start()

    def _cut_back(self, fd: int) -> bool:
        try:
            os.ftruncate(fd, self._size)
        except OSError:
            return False
        self._torn = False
        return True

    def _dropped(self, records: int, why: str) -> None:
        self.state.count_log_dropped(WRITE_FAILED, records)
        self.state.count_error("", "log_write")
        self._warn(f"write failed ({why})", records)

    def _warn(self, what: str, dropped: int) -> None:
        self._unreported += dropped
        now = time.monotonic()
        if now - self._last_warning < WARNING_INTERVAL_S:
            return
        self._last_warning = now
        log.warning("memtel: call log %s: %s; %d records dropped since the last such line (%s); the hook goes on, "
                    "this line repeats at most once a minute", self.path, what, self._unreported,
                    catalogue.HOOK_LOG_DROPPED_RECORDS.series)
        self._unreported = 0

    def close(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and thread.is_alive():
            thread.join(timeout)
        self.flush()
        for compressor in self._compressors:  # a segment left plain is read as well, so a timeout loses nothing
            compressor.join(timeout)
        with self._io_lock:
            if self._fd is not None:
                try:
                    os.close(self._fd)
                except OSError:
                    pass
                self._fd = None

    def reset_after_fork(self) -> None:
        """In a forked child: the parent's queue, file and thread are not ours."""
        if self._fd is not None:
            try:
                os.close(self._fd)  # the child's copy of the parent's descriptor
            except OSError:
                pass
        self._reset_process_state()


def _compress_segment(segment: str, warn: Callable[[str, int], None]) -> None:
    """`segment` -> `segment.gz` (gzip, written to a temporary name, fsynced, renamed), then the plain one is
    removed. On any error the plain segment stays (the reader reads it) and the temporary file is removed."""
    final = segment + ".gz"
    temporary = segment + ".gz.tmp"
    fd_out = None
    created = False  # only a temporary file this function created is ever removed
    try:
        fd_in = open_private(segment, os.O_RDONLY)
        try:
            fd_out = create_private(temporary, os.O_WRONLY)
            created = True
            compressor = zlib.compressobj(COMPRESS_LEVEL, zlib.DEFLATED, 31)  # 31: the gzip format
            while True:
                block = os.read(fd_in, COMPRESS_CHUNK_BYTES)
                if not block:
                    break
                write_all(fd_out, compressor.compress(block))
            write_all(fd_out, compressor.flush())
            os.fsync(fd_out)
        finally:
            os.close(fd_in)
        os.close(fd_out)
        fd_out = None
        os.rename(temporary, final)
        os.unlink(segment)
        fsync_dir(os.path.dirname(segment) or ".")
    except Exception as error:  # a full disk, a bug: the plain segment stays and is read as it is
        if fd_out is not None:
            try:
                os.close(fd_out)
            except OSError:
                pass
        if created:
            try:
                os.unlink(temporary)
            except OSError:
                pass
        warn(f"compressing {os.path.basename(segment)} failed ({error!r}); it stays uncompressed", 0)


def _write_some(fd: int, data: bytes) -> tuple[int, OSError | None]:
    """Write all of `data`, retrying short writes; (bytes written, the error that stopped it or None)."""
    view = memoryview(data)
    done = 0
    while done < len(data):
        try:
            written = os.write(fd, view[done:])
        except OSError as error:
            return done, error
        if written <= 0:
            return done, OSError(errno.EIO, f"write returned {written}")
        done += written
    return done, None


__all__ = ["COMPRESS_LEVEL", "ROTATE_BYTES", "WARNING_INTERVAL_S", "CallLogWriter", "log_file_name"]
