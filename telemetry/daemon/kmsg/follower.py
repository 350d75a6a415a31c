"""Follows the kernel log in a thread and feeds the counts. The only code that reads `/dev/kmsg`.

`/dev/kmsg` (a character device) returns exactly one record per read and `EPIPE` when the ring
buffer overwrote records we had not read yet; reading then goes on from the oldest record left,
and the gap in sequence numbers is counted as missed records. A plain file or a FIFO given with
`--kmsg` is read line by line and followed like `tail -f`.

A restart resumes after the saved sequence number. Without a state file (a lost state directory), it
resumes after the position the last daemon of this boot left in the runtime directory (position.py), with
counters from 0, instead of counting the whole ring buffer again. If the kernel's sequence numbers went backwards
(the saved record is not the kernel's record of that number, or the newest record is older than
the saved one: a reboot whose boot id could not be told apart), the counts start from zero and the
log is read again from its oldest record, instead of skipping every new record as "already counted".

When the log cannot be opened (no CAP_SYSLOG, missing path) the follower records the reason in
`error`, which makes the kmsg collector report failure, and retries every `retry_interval` seconds.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import stat
import threading
import time
from pathlib import Path

from telemetry.catalogue.metrics import KMSG_STATE_WRITE_FAILURES
from telemetry.daemon.kmsg.classify import Classifier
from telemetry.daemon.kmsg.counts import CountsSnapshot, KmsgCounts
from telemetry.daemon.kmsg.position import Position, load_position, save_position
from telemetry.daemon.kmsg.record import KmsgRecord, parse_record
from telemetry.daemon.kmsg.state import load_state, save_state

log = logging.getLogger("memtel.daemon.kmsg")

READ_SIZE = 16384  # larger than the biggest kmsg record (about 8 KiB with its properties)
POLL_MS = 200  # how often the thread looks at its stop flag and the persist timer when idle


class KmsgFollower:
    def __init__(
        self,
        path: str,
        classifier: Classifier,
        counts: KmsgCounts,
        *,
        state_path: Path | None,
        boot_id: str,
        persist_interval: float = 1.0,
        retry_interval: float = 10.0,
        position_path: Path | None = None,
    ) -> None:
        self.path = path
        self.classifier = classifier
        self.counts = counts
        self.state_path = state_path
        self.boot_id = boot_id
        self.position_path = position_path
        self.persist_interval = persist_interval
        self.retry_interval = retry_interval
        self.error: str | None = None  # why the log is not being read right now
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dirty = False
        self._last_persist = 0.0
        self._logged_errors: set[str] = set()
        self._overrun_logged = False
        self._have_seq = False
        # The saved position to verify against the kernel's log after a restart (None: nothing to verify).
        self._resume_seq: int | None = None
        self._resume_usec: int | None = None
        self._max_seq_seen: int | None = None
        self._rewind = False

    # -- lifecycle --------------------------------------------------------------------------------
    def load_state(self) -> None:
        """Restore counts from the state file (same boot, same source); logs one line either way."""
        if self.state_path is None:
            return
        result = load_state(self.state_path, self.boot_id, self.path)
        (log.warning if result.problem else log.info)("%s", result.message)
        snapshot = result.snapshot
        if snapshot is None and not result.problem and self.position_path is not None:
            # A lost state file: resume where the last daemon of this boot stopped, counters from 0.
            position, why = load_position(self.position_path, self.boot_id, self.path)
            log.info("%s", why)
            if position is not None:
                snapshot = CountsSnapshot(last_seq=position.last_seq, last_usec=position.last_usec)
        if snapshot is not None:
            self.counts.restore(snapshot)
            self._have_seq = snapshot.last_seq is not None
            self._resume_seq, self._resume_usec = snapshot.last_seq, snapshot.last_usec
        self.counts.set_state_write_failures(result.state_write_failures)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="memtel-kmsg", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.persist(force=True)

    # -- state --------------------------------------------------------------------------------------
    def persist(self, force: bool = False) -> None:
        if self.state_path is None or not self._dirty:
            return
        now = time.monotonic()
        if not force and now - self._last_persist < self.persist_interval:
            return
        self._last_persist = now
        snapshot = self.counts.snapshot()
        self._save_position(snapshot)
        try:
            save_state(self.state_path, snapshot, self.boot_id, self.path)
            self._dirty = False
        except OSError as exc:
            self.counts.add_state_write_failure()
            # strerror, not str(exc): the message names a random temporary file and must log once per cause.
            self._log_once(f"cannot write the kmsg state file {self.state_path}: {exc.strerror or exc} (the last good "
                           f"state is kept; counted in {KMSG_STATE_WRITE_FAILURES.series})")

    def _save_position(self, snapshot: CountsSnapshot) -> None:
        if self.position_path is None or snapshot.last_seq is None or self.boot_id == "unknown":
            return
        try:
            save_position(self.position_path, Position(self.boot_id, self.path, snapshot.last_seq,
                                                       snapshot.last_usec))
        except OSError as exc:
            self._log_once(f"cannot write the kernel-log position {self.position_path}: {exc.strerror or exc} "
                           "(a daemon that loses its state directory will count the kernel log again)")

    # -- reading ------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            fd = self._open()
            if fd is None:
                self._stop.wait(self.retry_interval)
                continue
            try:
                if stat.S_ISCHR(os.fstat(fd).st_mode):
                    self._follow_device(fd)
                else:
                    self._follow_stream(fd)
            except OSError as exc:
                self._fail(f"reading the kernel log {self.path} failed: {exc}")
            finally:
                os.close(fd)
                self.persist(force=True)
            if not self._stop.is_set():
                self._stop.wait(self.retry_interval)

    def _open(self) -> int | None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            hint = ""
            if exc.errno in (errno.EACCES, errno.EPERM):
                hint = " (reading /dev/kmsg needs root or CAP_SYSLOG; see configs/systemd/memtel-daemon.service)"
            self._fail(f"cannot read the kernel log {self.path}: {exc.strerror}{hint}")
            return None
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.close(fd)
            self._fail(f"cannot read the kernel log {self.path}: it is a directory "
                       "(expected /dev/kmsg, a file or a FIFO)")
            return None
        if self.error is not None:
            log.info("reading the kernel log %s again", self.path)
        self.error = None
        self._logged_errors.clear()
        return fd

    def _fail(self, message: str) -> None:
        self.error = message
        self._log_once(message)

    def _log_once(self, message: str) -> None:
        if message not in self._logged_errors:
            self._logged_errors.add(message)
            log.warning("%s", message)

    def _follow_device(self, fd: int) -> None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while not self._stop.is_set():
            while True:
                try:
                    chunk = os.read(fd, READ_SIZE)
                except BlockingIOError:
                    break
                except BrokenPipeError:
                    if not self._overrun_logged:
                        self._overrun_logged = True
                        log.warning("kernel log ring buffer overran: records were lost (counted as missed)")
                    continue
                if not chunk:
                    break
                record = parse_record(chunk.decode("utf-8", "replace"))
                if record is not None:
                    self._handle(record, device=True)
                if self._rewind:
                    self._start_over(fd)
                if self._stop.is_set():
                    return
            if self._resume_seq is not None:  # caught up with the kernel's newest record once
                if self._max_seq_seen is not None and self._max_seq_seen < self._resume_seq:
                    self._new_boot(f"the kernel's newest record is {self._max_seq_seen}")
                    self._start_over(fd)
                    continue
                self._resume_seq = None
            self.persist()
            poller.poll(POLL_MS)

    def _new_boot(self, why: str) -> None:
        log.warning("kernel log sequence numbers went backwards (saved state: record %s; %s): treating this as a new "
                    "boot, counters start from 0 and the log is read from its oldest record", self._resume_seq, why)
        self.counts.reset_for_new_boot()
        self._have_seq = False
        self._resume_seq = self._resume_usec = self._max_seq_seen = None
        self._dirty = True
        self._rewind = True

    def _start_over(self, fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)  # /dev/kmsg: back to the oldest record in the ring buffer
        self._rewind = False

    def _follow_stream(self, fd: int) -> None:
        # A regular file resumes at the byte offset saved with the counts (its lines may carry no sequence
        # number); a file shorter than that offset was truncated or replaced and is read from its start.
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        offset = self.counts.stream_offset if regular else None
        if offset is not None and os.fstat(fd).st_size >= offset:
            os.lseek(fd, offset, os.SEEK_SET)
        elif regular:
            offset = 0
        pending = b""
        while not self._stop.is_set():
            try:
                chunk = os.read(fd, READ_SIZE)
            except BlockingIOError:
                chunk = None
            if chunk:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if offset is not None:
                        offset += len(line) + 1
                    if line.startswith(b" "):
                        continue  # a continuation line: properties, not classified
                    record = parse_record(line.decode("utf-8", "replace"))
                    if record is not None:
                        self._handle(record, offset)
                    elif offset is not None:
                        self.counts.set_stream_offset(offset)
                continue
            if regular and os.fstat(fd).st_size < (offset or 0) + len(pending):
                log.info("%s was truncated: reading it from its start", self.path)  # copytruncate rotation
                os.lseek(fd, 0, os.SEEK_SET)
                offset, pending = 0, b""
                continue
            # End of a file (follow it like tail -f) or a FIFO without a writer: wait for more.
            self.persist()
            self._stop.wait(POLL_MS / 1000)

    def _handle(self, record: KmsgRecord, stream_offset: int | None = None, *, device: bool = False) -> None:
        seq = record.seq
        if seq is not None and device and self._resume_seq is not None:
            if self._max_seq_seen is None or seq > self._max_seq_seen:
                self._max_seq_seen = seq
            if seq == self._resume_seq and self._resume_usec is not None and record.usec != self._resume_usec:
                self._new_boot(f"the kernel's record {seq} was logged at {record.usec} us, the saved one at "
                               f"{self._resume_usec} us")
                return
        if seq is not None:
            last = self.counts.last_seq
            if last is not None and self._have_seq:
                if seq <= last:
                    if stream_offset is not None:
                        self.counts.set_stream_offset(stream_offset)
                    return  # counted before a restart
                if seq > last + 1:
                    self.counts.add_missed(seq - last - 1)
            self._have_seq = True
        now_wall, now_mono = time.time(), time.monotonic()
        if record.usec is not None:
            usec = record.usec
            wall = now_wall - now_mono + usec / 1e6  # the kernel stamps records with its monotonic clock
        else:
            usec, wall = int(now_mono * 1e6), now_wall
        ignored = self.classifier.is_ignored(record)
        kinds = [] if ignored else self.classifier.classify(record)
        self.counts.add_record(kinds, usec, wall, seq, stream_offset, ignored_test_line=ignored)
        self._dirty = True
