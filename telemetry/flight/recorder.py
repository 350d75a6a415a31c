"""The flight recorder: once a second, one record of every node signal into an on-disk ring.

Hosts that wedge take their local logs and any local Prometheus with them; the ring keeps the last
minutes (default 15) where the next boot can read them (`memtel flight show --boot previous`).

Files, in `<state dir>/flight/` (a private directory, created 0700):
- `current.ring`: this boot's ring (ring.py: preallocated, one CRC-checked record per slot, each
  record made durable with fdatasync before the next one is taken);
- `previous.ring`: the ring of the boot before, moved there when the daemon first starts in a new boot
  (boot id from /proc/sys/kernel/random/boot_id), so the last records before a crash survive the
  next boot's recording. A ring whose header is unreadable is moved aside (`.corrupt-<time>`); its records
  are still read (each has its own checksum): `memtel flight show --file <the moved-aside file>`, and a
  previous.ring's records still give the last boot's summary.

The recorder never stops the daemon: a failure to create or write the ring (a full or read-only file
system, an unsafe directory) is counted in `memtel_flight_write_failures_total`, sets
`memtel_flight_recording` to 0 and is logged once; it retries every `retry_seconds`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import Metric

from telemetry.catalogue import FAMILIES
from telemetry.catalogue.metrics import (
    COLLECTOR_DURATION,
    FLIGHT_LAST_RECORD_BYTES,
    FLIGHT_LAST_RECORD_TIME,
    FLIGHT_LAST_WRITE_DURATION,
    FLIGHT_PREVIOUS_BOOT_LAST_RECORD_TIME,
    FLIGHT_PREVIOUS_BOOT_MIN_HEADROOM,
    FLIGHT_PREVIOUS_BOOT_RECORDS,
    FLIGHT_RECORDING,
    FLIGHT_RECORDS_WRITTEN,
    FLIGHT_WRITE_FAILURES,
    UNIFIED_HEADROOM,
)
from telemetry.flight.ring import (
    Record,
    RingContents,
    RingFormatError,
    RingHeader,
    RingWriter,
    create_ring,
    encode_record,
    new_header,
    read_ring,
    slot_bytes_for,
    slots_for,
)
from telemetry.safefs import UnsafePathError, ensure_private_dir, fsync_dir, move_aside, remove_stale_temporaries

log = logging.getLogger("memtel.daemon.flight")

CURRENT_RING = "current.ring"
PREVIOUS_RING = "previous.ring"
HEADROOM_SERIES = UNIFIED_HEADROOM.series
DEFAULT_DURATION_SECONDS = 900.0
DEFAULT_INTERVAL_SECONDS = 1.0
# Collector series that change on every sample and say nothing about the node, and the recorder's own series
# (in a scrape's families).
_SKIPPED_SERIES = frozenset({COLLECTOR_DURATION.series, *(
    name for entry in FAMILIES.values() if entry.source == "flight" for name in entry.sample_names)})


def series_key(name: str, labels: dict[str, str]) -> str:
    """`name{a="x",b="y"}` (labels sorted, values escaped as in the Prometheus text format)."""
    if not labels:
        return name
    parts = []
    for key in sorted(labels):
        value = labels[key].replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        parts.append(f'{key}="{value}"')
    return f"{name}{{{','.join(parts)}}}"


def series_values(families: Iterable[Metric], skip: frozenset[str] = _SKIPPED_SERIES) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            if sample.name not in skip and sample.labels.get("collector") != "flight":
                values[series_key(sample.name, sample.labels)] = float(sample.value)
    return values


@dataclass(frozen=True)
class BootSummary:
    """What the ring of one boot holds: how many records, the last one's time, the lowest headroom."""

    boot_id: str
    records: int
    last_record_time: float | None
    min_headroom_bytes: float | None


def summarize(contents: RingContents) -> BootSummary:
    headroom = [r.values[HEADROOM_SERIES] for r in contents.records if HEADROOM_SERIES in r.values]
    return BootSummary(
        boot_id=contents.header.boot_id, records=len(contents.records),
        last_record_time=contents.records[-1].time if contents.records else None,
        min_headroom_bytes=min(headroom) if headroom else None,
    )


def _describe(contents: RingContents, name: str) -> None:
    """One log line for a ring with torn or damaged records or other problems (never one per record)."""
    if contents.corrupt or contents.problems:
        log.warning("flight recorder: %s: skipped %d torn or corrupt record(s); %s", name, contents.corrupt,
                    "; ".join(contents.problems))


class FlightRecorder:
    """Owns the ring files of one state directory. Also the `flight` collector (its own health series)."""

    def __init__(self, directory: str | os.PathLike[str], boot_id: str, *,
                 duration_seconds: float = DEFAULT_DURATION_SECONDS,
                 interval_seconds: float = DEFAULT_INTERVAL_SECONDS,
                 clock: Callable[[], float] = time.time, sync: Callable[[int], None] = os.fdatasync,
                 retry_seconds: float = 10.0) -> None:
        self.directory = Path(directory)
        self.boot_id = boot_id
        self.duration_seconds = duration_seconds
        self.interval_seconds = interval_seconds
        self.slots = slots_for(duration_seconds, interval_seconds)
        self.clock = clock
        self.sync = sync
        self.retry_seconds = retry_seconds
        self.current_path = self.directory / CURRENT_RING
        self.previous_path = self.directory / PREVIOUS_RING
        self.previous: BootSummary | None = None
        self.next_seq = 0
        self.writer: RingWriter | None = None
        self.records_written = 0
        self.write_failures = 0
        self.recording = False
        self.last_record_time: float | None = None
        self.last_write_seconds: float | None = None
        self.last_record_bytes: int | None = None
        self._failing_since: str | None = None
        self._retry_at = 0.0
        self._ready = False  # the directory is usable and the rings of earlier boots are sorted out
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- start: keep the previous boot's ring, find where this boot's ring left off ---------------------
    def prepare(self) -> None:
        """Rotate the ring of an earlier boot to previous.ring and read both rings. Never raises; on a
        failure the recorder is not ready and `record` tries again after `retry_seconds`."""
        try:
            ensure_private_dir(self.directory, what="flight recorder directory")
            remove_stale_temporaries(self.current_path)
        except (UnsafePathError, OSError) as exc:
            self._fail(f"cannot use {self.directory}: {exc}")
            return
        previous: RingContents | None = None
        current = self._read(self.current_path)
        if current is not None and current.header.boot_id != self.boot_id:
            try:
                os.replace(self.current_path, self.previous_path)
                fsync_dir(self.directory)
                log.info("flight recorder: boot id changed (%s -> %s); the last boot's %d record(s) are kept in %s",
                         current.header.boot_id, self.boot_id, len(current.records), self.previous_path)
                previous, current = current, None
            except OSError as exc:
                self._fail(f"cannot keep the last boot's ring as {self.previous_path}: {exc.strerror}")
                return
        if previous is None:
            previous = self._read(self.previous_path)
        if previous is not None:
            self.previous = summarize(previous)
        if current is not None:
            self.next_seq = current.records[-1].seq + 1 if current.records else 0
        self._ready = True

    def _read(self, path: Path) -> RingContents | None:
        if not os.path.lexists(path):
            return None
        try:
            contents = read_ring(path)
        except (RingFormatError, OSError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            try:
                aside = move_aside(path)
                log.warning("flight recorder: %s is not a usable ring (%s); moved aside to %s", path, reason, aside)
            except OSError as move_exc:
                log.warning("flight recorder: %s is not a usable ring (%s) and cannot be moved aside: %s",
                            path, reason, move_exc.strerror)
            return None
        if contents.header_damage is not None:  # no writer can use it; its records stay readable where it goes
            try:
                aside = move_aside(path)
            except OSError as move_exc:
                log.warning("flight recorder: %s has a damaged header (%s) and cannot be moved aside: %s", path,
                            contents.header_damage, move_exc.strerror)
                return None
            log.warning("flight recorder: %s has a damaged header (%s); %d record(s) whose checksums hold were "
                        "recovered; moved aside to %s (read it with: memtel flight show --file %s)", path,
                        contents.header_damage, len(contents.records), aside, aside)
            return contents if path == self.previous_path else None  # whose boot the current ring was: unknown
        _describe(contents, path.name)
        return contents

    # -- recording ---------------------------------------------------------------------------------
    def record(self, values: dict[str, float], timestamp: float | None = None) -> bool:
        """Append one record of `values` (taken at `timestamp`, default now) and make it durable; False if
        it was not written."""
        if self.writer is None and time.monotonic() < self._retry_at:
            return False
        if not self._ready:
            self.prepare()
            if not self._ready:
                return False
        if timestamp is None:
            timestamp = self.clock()
        data = encode_record(self.next_seq, timestamp, values)
        try:
            if self.writer is None:
                self.writer = self._open_writer(len(data))
            elif not self.writer.fits(data):
                self.writer.close()
                self.writer = None
                self.writer = self._open_writer(len(data))
            started = time.perf_counter()
            self.writer.write(self.next_seq, data)
            elapsed = time.perf_counter() - started
        except (OSError, RingFormatError, UnsafePathError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self._fail(f"writing {self.current_path} failed: {reason}")
            return False
        with self._lock:
            self.next_seq += 1
            self.records_written += 1
            self.recording = True
            self.last_record_time = timestamp
            self.last_write_seconds = elapsed
            self.last_record_bytes = len(data)
        if self._failing_since is not None:
            log.info("flight recorder: recording again into %s (was failing: %s)", self.current_path,
                     self._failing_since)
            self._failing_since = None
        return True

    def _open_writer(self, record_bytes: int) -> RingWriter:
        """The writer of this boot's ring: the existing file if its shape fits, else a new file that keeps
        the newest records of the old one."""
        ensure_private_dir(self.directory, what="flight recorder directory")  # again: it may have been replaced
        if os.path.lexists(self.current_path):
            writer = RingWriter(self.current_path, self.sync)
            shape = writer.header
            if shape.slots == self.slots and shape.slot_bytes >= record_bytes and shape.boot_id == self.boot_id:
                return writer
            writer.close()
            self._rebuild(record_bytes)
        else:
            create_ring(self.current_path, new_header(self.boot_id, self.duration_seconds, self.interval_seconds,
                                                      record_bytes))
        return RingWriter(self.current_path, self.sync)

    def _rebuild(self, record_bytes: int) -> None:
        old = read_ring(self.current_path)
        slot_bytes = max(old.header.slot_bytes, slot_bytes_for(record_bytes))
        header = RingHeader(boot_id=self.boot_id, slots=self.slots, slot_bytes=slot_bytes,
                            interval_seconds=self.interval_seconds, created=time.time())
        kept: dict[int, Record] = {}
        for record in reversed(old.records):  # newest first; one per slot
            kept.setdefault(record.seq % header.slots, record)
        records = [(r.seq, encode_record(r.seq, r.time, r.values)) for r in kept.values()]
        create_ring(self.current_path, header, [(seq, data) for seq, data in records if len(data) <= slot_bytes])
        log.info("flight recorder: %s rebuilt with %d slots of %d bytes (kept %d records)", self.current_path,
                 header.slots, header.slot_bytes, len(records))

    def _fail(self, message: str) -> None:
        with self._lock:
            self.write_failures += 1
            self.recording = False
        if self.writer is not None:
            try:
                self.writer.close()
            except OSError:
                pass
            self.writer = None
        self._retry_at = time.monotonic() + self.retry_seconds
        if self._failing_since is None:
            log.warning("flight recorder: %s; recording stopped, retrying every %g s (the exporter keeps serving)",
                        message, self.retry_seconds)
            self._failing_since = message

    # -- the thread ----------------------------------------------------------------------------------
    def start(self, sample: Callable[[], tuple[float, dict[str, float]]]) -> None:
        """Record `sample()` ((Unix time, values)) every interval in a thread until `stop()`."""
        if not self._ready:
            self.prepare()
        self._thread = threading.Thread(target=self._run, args=(sample,), name="memtel-flight", daemon=True)
        self._thread.start()

    def _run(self, sample: Callable[[], tuple[float, dict[str, float]]]) -> None:
        next_tick = time.monotonic()
        while not self._stop.is_set():
            try:
                timestamp, values = sample()
                self.record(values, timestamp)
            except Exception:  # the recorder must never take the daemon down
                log.exception("flight recorder: taking a record failed")
            next_tick += self.interval_seconds
            now = time.monotonic()
            if next_tick < now:  # fell behind (a slow disk): skip the missed ticks, do not burst
                next_tick = now + self.interval_seconds - (now - next_tick) % self.interval_seconds
            self._stop.wait(next_tick - now)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    # -- the `flight` collector ---------------------------------------------------------------------
    def collect(self) -> list[Metric]:
        with self._lock:
            recording, written, failures = self.recording, self.records_written, self.write_failures
            last_time, last_write, last_bytes = self.last_record_time, self.last_write_seconds, self.last_record_bytes
        families: list[Metric] = [FLIGHT_RECORDING.new(1 if recording else 0),
                                  FLIGHT_RECORDS_WRITTEN.new(written), FLIGHT_WRITE_FAILURES.new(failures)]
        optional = [(FLIGHT_LAST_RECORD_TIME, last_time), (FLIGHT_LAST_WRITE_DURATION, last_write),
                    (FLIGHT_LAST_RECORD_BYTES, last_bytes)]
        previous = self.previous
        if previous is not None:
            optional += [(FLIGHT_PREVIOUS_BOOT_RECORDS, previous.records),
                         (FLIGHT_PREVIOUS_BOOT_LAST_RECORD_TIME, previous.last_record_time),
                         (FLIGHT_PREVIOUS_BOOT_MIN_HEADROOM, previous.min_headroom_bytes)]
        families += [entry.new(value) for entry, value in optional if value is not None]
        return families
