"""Line counters, burst events and last-seen times per kind, with a snapshot for the collector.

An event is a burst: a line of a kind starts a new event when it comes more than `window_seconds`
after the first line of the kind's current event (the driver logs many lines for one failure).
Times are the records' kernel timestamps, so replaying the same records gives the same events.
Xid codes are bounded: past `max_xid_codes` distinct codes, new ones count as `xid:other`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from telemetry.daemon.kmsg.classify import XID_PREFIX

XID_OTHER = XID_PREFIX + "other"


@dataclass
class CountsSnapshot:
    lines: dict[str, int] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=dict)
    event_start_usec: dict[str, int] = field(default_factory=dict)  # first line of the current event
    last_seen_usec: dict[str, int] = field(default_factory=dict)  # kernel monotonic time, for the state file
    last_seen_wall: dict[str, float] = field(default_factory=dict)  # Unix time, for the metrics
    records: int = 0
    missed: int = 0
    state_write_failures: int = 0
    ignored_test_lines: int = 0  # lines of memtel's own test suite, read and counted nowhere else
    last_seq: int | None = None
    last_usec: int | None = None  # kernel time of the record `last_seq` (tells a new boot with the same boot id)
    stream_offset: int | None = None  # bytes consumed of a plain file given with --kmsg (restart point)


class KmsgCounts:
    """Thread-safe: the follower thread adds, the scrape thread snapshots."""

    def __init__(self, window_seconds: float = 2.0, max_xid_codes: int = 32) -> None:
        self.window_usec = int(window_seconds * 1e6)
        self.max_xid_codes = max_xid_codes
        self._lock = threading.Lock()
        self._lines: dict[str, int] = {}
        self._events: dict[str, int] = {}
        self._event_start_usec: dict[str, int] = {}
        self._last_seen_usec: dict[str, int] = {}
        self._last_seen_wall: dict[str, float] = {}
        self._records = 0
        self._missed = 0
        self._state_write_failures = 0
        self._ignored_test_lines = 0
        self._last_seq: int | None = None
        self._last_usec: int | None = None
        self._stream_offset: int | None = None

    def _bounded(self, kind: str) -> str:
        if not kind.startswith(XID_PREFIX) or kind in self._lines:
            return kind
        codes = sum(1 for k in self._lines if k.startswith(XID_PREFIX) and k != XID_OTHER)
        return kind if codes < self.max_xid_codes else XID_OTHER

    def add_record(
        self, kinds: list[str], usec: int, wall: float, seq: int | None, stream_offset: int | None = None,
        *, ignored_test_line: bool = False,
    ) -> None:
        """Count one record read from the log, with the kinds the classifier gave it."""
        with self._lock:
            self._records += 1
            if ignored_test_line:
                self._ignored_test_lines += 1
            if seq is not None:
                self._last_seq = seq
                self._last_usec = usec
            if stream_offset is not None:
                self._stream_offset = stream_offset
            for raw_kind in kinds:
                kind = self._bounded(raw_kind)
                self._lines[kind] = self._lines.get(kind, 0) + 1
                start = self._event_start_usec.get(kind)
                if start is None or usec - start > self.window_usec or usec < start:
                    self._events[kind] = self._events.get(kind, 0) + 1
                    self._event_start_usec[kind] = usec
                self._last_seen_usec[kind] = usec
                self._last_seen_wall[kind] = wall

    def add_missed(self, count: int) -> None:
        with self._lock:
            self._missed += count

    def add_state_write_failure(self) -> None:
        with self._lock:
            self._state_write_failures += 1

    def set_state_write_failures(self, count: int) -> None:
        """Carry the failure count of an earlier run over (the counts themselves may start from zero)."""
        with self._lock:
            self._state_write_failures = max(self._state_write_failures, count)

    def reset_for_new_boot(self) -> None:
        """Zero every kernel-log count (the log is another boot's); the state-write failures stay."""
        failures = self.snapshot().state_write_failures
        self.restore(CountsSnapshot(state_write_failures=failures))

    def set_stream_offset(self, offset: int | None) -> None:
        with self._lock:
            self._stream_offset = offset

    @property
    def stream_offset(self) -> int | None:
        with self._lock:
            return self._stream_offset

    @property
    def last_seq(self) -> int | None:
        with self._lock:
            return self._last_seq

    @property
    def last_usec(self) -> int | None:
        with self._lock:
            return self._last_usec

    def snapshot(self) -> CountsSnapshot:
        with self._lock:
            return CountsSnapshot(
                lines=dict(self._lines),
                events=dict(self._events),
                event_start_usec=dict(self._event_start_usec),
                last_seen_usec=dict(self._last_seen_usec),
                last_seen_wall=dict(self._last_seen_wall),
                records=self._records,
                missed=self._missed,
                state_write_failures=self._state_write_failures,
                ignored_test_lines=self._ignored_test_lines,
                last_seq=self._last_seq,
                last_usec=self._last_usec,
                stream_offset=self._stream_offset,
            )

    def restore(self, snap: CountsSnapshot) -> None:
        """Continue from a saved state (same boot): counts, event windows and the last sequence number."""
        with self._lock:
            self._lines = dict(snap.lines)
            self._events = dict(snap.events)
            self._event_start_usec = dict(snap.event_start_usec)  # an event in progress at shutdown continues
            self._last_seen_usec = dict(snap.last_seen_usec)
            self._last_seen_wall = dict(snap.last_seen_wall)
            self._records = snap.records
            self._missed = snap.missed
            self._state_write_failures = snap.state_write_failures
            self._ignored_test_lines = snap.ignored_test_lines
            self._last_seq = snap.last_seq
            self._last_usec = snap.last_usec
            self._stream_offset = snap.stream_offset
