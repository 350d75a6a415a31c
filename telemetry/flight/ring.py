"""The flight recorder's ring file: a preallocated file of fixed-size slots, one record per slot.

Layout (little-endian):

    header   HEADER_BYTES: b"MEMTELFR" | u32 version | u32 n | u32 crc32(json) | n bytes of JSON
             {boot_id, slots, slot_bytes, interval_seconds, created} | zeros
    slot i   at HEADER_BYTES + i × slot_bytes; the record with sequence number s is in slot s % slots:
             b"MTR1" | u32 payload length | u64 seq | u32 crc32(length, seq, payload) | payload | stale bytes
    payload  zlib-compressed JSON {"t": unix time, "v": {series: value}}

Why this shape: the whole file is written once when it is created (zeros), so a disk that fills up
later does not stop the recording (on file systems that overwrite in place); a record is one `pwrite`
into its own slot, so a kill or a crash mid-write can tear only that slot, which its CRC then rejects;
the file never grows. Slots are 4 KiB-aligned (a page), so a record that fits in one page is written
or not, as a whole, when the writer is killed.

Reading is defensive (the file may be damaged or hostile): every length is bounded, a slot that starts
with the record magic but fails its checks is counted as corrupt and skipped, an empty slot is not.
A damaged header does not hide the records: each record carries its own sequence number and checksum,
and slots start on 4 KiB boundaries, so `read_ring` then scans every such boundary and keeps each record
whose checksum holds (`RingContents.header_damage` says why; boot id and geometry are then unknown).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from telemetry.safefs import create_private, fsync_dir, open_private, temporary_name, write_all

FILE_MAGIC = b"MEMTELFR"
FILE_VERSION = 1
HEADER_BYTES = 4096
RECORD_MAGIC = b"MTR1"
_FILE_HEAD = struct.Struct("<8sIII")  # magic, version, json length, crc32(json)
_RECORD_HEAD = struct.Struct("<4sIQI")  # magic, payload length, seq, crc32
RECORD_OVERHEAD = _RECORD_HEAD.size
MIN_SLOT_BYTES = 4096
MAX_SLOT_BYTES = 1 << 20
MAX_SLOTS = 100_000
MAX_PAYLOAD_JSON_BYTES = 16 << 20  # a decompressed payload larger than this is refused


class RingFormatError(ValueError):
    """The file is not a ring file this version can read (bad magic, version, header or geometry)."""


@dataclass(frozen=True)
class RingHeader:
    boot_id: str
    slots: int
    slot_bytes: int
    interval_seconds: float
    created: float = 0.0

    def __post_init__(self) -> None:
        if not 2 <= self.slots <= MAX_SLOTS:
            raise RingFormatError(f"{self.slots} slots; expected 2 to {MAX_SLOTS}")
        if not (MIN_SLOT_BYTES <= self.slot_bytes <= MAX_SLOT_BYTES) or self.slot_bytes & (self.slot_bytes - 1):
            raise RingFormatError(f"slot size {self.slot_bytes}; expected a power of two from {MIN_SLOT_BYTES} "
                                  f"to {MAX_SLOT_BYTES}")

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.slots * self.slot_bytes

    def slot_offset(self, seq: int) -> int:
        return HEADER_BYTES + (seq % self.slots) * self.slot_bytes

    def encode(self) -> bytes:
        text = json.dumps({"boot_id": self.boot_id, "slots": self.slots, "slot_bytes": self.slot_bytes,
                           "interval_seconds": self.interval_seconds, "created": self.created}).encode()
        head = _FILE_HEAD.pack(FILE_MAGIC, FILE_VERSION, len(text), zlib.crc32(text)) + text
        if len(head) > HEADER_BYTES:
            raise RingFormatError("header too long (boot id too long?)")
        return head + bytes(HEADER_BYTES - len(head))

    @classmethod
    def decode(cls, block: bytes) -> RingHeader:
        if len(block) < _FILE_HEAD.size:
            raise RingFormatError("shorter than a ring header")
        magic, version, length, crc = _FILE_HEAD.unpack_from(block)
        if magic != FILE_MAGIC:
            raise RingFormatError("not a memtel flight ring (bad magic)")
        if version != FILE_VERSION:
            raise RingFormatError(f"ring format version {version}; this memtel reads version {FILE_VERSION}")
        if length > HEADER_BYTES - _FILE_HEAD.size:
            raise RingFormatError("header length out of range")
        text = block[_FILE_HEAD.size:_FILE_HEAD.size + length]
        if len(text) != length or zlib.crc32(text) != crc:
            raise RingFormatError("header checksum mismatch")
        try:
            data = json.loads(text)
            return cls(boot_id=str(data["boot_id"]), slots=int(data["slots"]), slot_bytes=int(data["slot_bytes"]),
                       interval_seconds=float(data["interval_seconds"]), created=float(data.get("created", 0.0)))
        except (ValueError, KeyError, TypeError) as exc:
            raise RingFormatError(f"header is not valid: {exc}") from None


@dataclass(frozen=True)
class Record:
    seq: int
    time: float
    values: dict[str, float]


def encode_record(seq: int, timestamp: float, values: dict[str, float]) -> bytes:
    """A record as written into its slot (without the slot's padding)."""
    payload = zlib.compress(json.dumps({"t": timestamp, "v": values}, separators=(",", ":")).encode(), 1)
    crc = zlib.crc32(payload, zlib.crc32(struct.pack("<IQ", len(payload), seq)))
    return _RECORD_HEAD.pack(RECORD_MAGIC, len(payload), seq, crc) + payload


class CorruptRecordError(ValueError):
    pass


def decode_slot(data: bytes) -> Record | None:
    """The record in a slot; None for a slot without one (never written, or remnants); CorruptRecordError
    for a slot that starts like a record but is torn or damaged."""
    if len(data) < RECORD_OVERHEAD or data[:4] != RECORD_MAGIC:
        return None
    _, length, seq, crc = _RECORD_HEAD.unpack_from(data)
    payload = data[RECORD_OVERHEAD:RECORD_OVERHEAD + length]
    if len(payload) != length:
        raise CorruptRecordError(f"record {seq}: length {length} runs past its slot")
    if zlib.crc32(payload, zlib.crc32(struct.pack("<IQ", length, seq))) != crc:
        raise CorruptRecordError(f"record {seq}: checksum mismatch (torn or damaged)")
    try:
        inflater = zlib.decompressobj()
        text = inflater.decompress(payload, MAX_PAYLOAD_JSON_BYTES)
        if inflater.unconsumed_tail:
            raise CorruptRecordError(f"record {seq}: payload decompresses past {MAX_PAYLOAD_JSON_BYTES} bytes")
        data_obj = json.loads(text)
    except (zlib.error, ValueError) as exc:
        raise CorruptRecordError(f"record {seq}: payload is not valid: {exc}") from None
    if not isinstance(data_obj, dict) or not isinstance(data_obj.get("t"), (int, float)):
        raise CorruptRecordError(f"record {seq}: payload has no time")
    values = data_obj.get("v")
    if not isinstance(values, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in values.items()):
        raise CorruptRecordError(f"record {seq}: values are not a mapping of series to numbers")
    return Record(seq=seq, time=float(data_obj["t"]), values=values)


@dataclass
class RingContents:
    header: RingHeader
    records: list[Record] = field(default_factory=list)  # oldest first, each sequence number once
    corrupt: int = 0  # slots that started like a record but failed their checks (torn, damaged)
    problems: list[str] = field(default_factory=list)  # what was wrong, for one log line
    header_damage: str | None = None  # why the header was unreadable; the records were found by a scan


def read_header(fd: int) -> RingHeader:
    return RingHeader.decode(os.pread(fd, HEADER_BYTES, 0))


UNKNOWN_BOOT_ID = "unknown (header damaged)"
_SCAN_CHUNK = 1 << 20
_SCAN_GIVE_UP = 1024  # damaged records after which a scan stops


def read_ring_fd(fd: int) -> RingContents:
    """Every valid record; with a damaged header, every record found by `scan_records` (RingFormatError
    only when the header is damaged and no record is found: then it is not a ring at all)."""
    try:
        header = read_header(fd)
    except RingFormatError as exc:
        return scan_records(fd, str(exc))
    contents = RingContents(header)
    size = os.fstat(fd).st_size
    if size > header.file_bytes:
        contents.problems.append(f"{size - header.file_bytes} bytes past the end of the ring ignored")
    elif size < header.file_bytes:
        contents.problems.append(f"file is {header.file_bytes - size} bytes shorter than its ring")
    by_seq: dict[int, Record] = {}
    for slot in range(header.slots):
        data = os.pread(fd, header.slot_bytes, HEADER_BYTES + slot * header.slot_bytes)
        try:
            record = decode_slot(data)
        except CorruptRecordError as exc:
            contents.corrupt += 1
            if contents.corrupt <= 3:
                contents.problems.append(str(exc))
            continue
        if record is None:
            continue
        if record.seq % header.slots != slot or record.seq in by_seq:
            contents.corrupt += 1
            if contents.corrupt <= 3:
                contents.problems.append(f"record {record.seq} found in slot {slot}, where it cannot be")
            continue
        by_seq[record.seq] = record
    contents.records = [by_seq[seq] for seq in sorted(by_seq)]
    return contents


def scan_records(fd: int, header_damage: str) -> RingContents:
    """The records of a ring whose header cannot be read: every 4 KiB boundary past the header that holds a
    record whose own checksum holds. Each sequence number is kept once (a second copy counts as corrupt).
    If the file lost or gained bytes before its slots (so no boundary holds a record), the boundaries are
    taken from the first record found anywhere (a bounded search)."""
    size = min(os.fstat(fd).st_size, HEADER_BYTES + MAX_SLOTS * MAX_SLOT_BYTES)
    contents = _scan_from(fd, HEADER_BYTES, size, header_damage)
    if not contents.records:
        start = _first_record_anywhere(fd, size)
        if start is not None:
            contents = _scan_from(fd, start % MIN_SLOT_BYTES or MIN_SLOT_BYTES, size, header_damage)
    if not contents.records:
        raise RingFormatError(f"{header_damage}, and no record was found in the file")
    return contents


def _try_record(fd: int, at: int) -> tuple[Record | None, int, str | None]:
    """(record, its length on disk, why it was rejected) for the bytes at `at`, which start with the magic."""
    length = _RECORD_HEAD.unpack_from(os.pread(fd, RECORD_OVERHEAD, at))[1]
    data = os.pread(fd, RECORD_OVERHEAD + min(length, MAX_SLOT_BYTES - RECORD_OVERHEAD), at)
    try:
        return decode_slot(data), RECORD_OVERHEAD + length, None
    except CorruptRecordError as exc:
        return None, 0, str(exc)


def _scan_from(fd: int, first: int, size: int, header_damage: str) -> RingContents:
    found: list[tuple[int, Record]] = []  # (offset, record)
    by_seq: dict[int, Record] = {}
    corrupt = 0
    problems: list[str] = []
    offset = first
    while offset + RECORD_OVERHEAD <= size:
        chunk = os.pread(fd, min(_SCAN_CHUNK, size - offset), offset)
        if not chunk:
            break
        position = 0
        while position < len(chunk):
            if chunk[position:position + 4] != RECORD_MAGIC or offset + position + RECORD_OVERHEAD > size:
                position += MIN_SLOT_BYTES
                continue
            record, used, problem = _try_record(fd, offset + position)
            if record is None or record.seq in by_seq:
                corrupt += 1
                if corrupt <= 3:
                    problems.append(problem or f"record {record.seq if record else '?'} found twice")
                if corrupt >= _SCAN_GIVE_UP:  # each costs up to a slot's read and checksum: bound the total
                    problems.append(f"scan stopped after {corrupt} damaged records")
                    offset = size
                    break
                position += MIN_SLOT_BYTES
                continue
            by_seq[record.seq] = record
            found.append((offset + position, record))
            position += -(-used // MIN_SLOT_BYTES) * MIN_SLOT_BYTES  # no other record starts inside this one
        offset += position
    records = [by_seq[seq] for seq in sorted(by_seq)]
    header = _guessed_header(found, records, size, first)
    return RingContents(header, records, corrupt, problems, header_damage)


def _first_record_anywhere(fd: int, size: int, attempts: int = 256) -> int | None:
    """The offset of the first valid record at any byte offset; at most `attempts` candidates are checked,
    so a file full of the magic costs bounded time."""
    offset = 0
    while offset + RECORD_OVERHEAD <= size and attempts > 0:
        chunk = os.pread(fd, min(_SCAN_CHUNK, size - offset), offset)
        position = chunk.find(RECORD_MAGIC)
        while position >= 0 and attempts > 0:
            if offset + position + RECORD_OVERHEAD <= size:
                attempts -= 1
                if _try_record(fd, offset + position)[0] is not None:
                    return offset + position
            position = chunk.find(RECORD_MAGIC, position + 1)
        if len(chunk) < _SCAN_CHUNK:
            break
        offset += len(chunk) - 3  # a magic split between two chunks is still found
    return None


def _guessed_header(found: list[tuple[int, Record]], records: list[Record], size: int, first: int) -> RingHeader:
    """A stand-in header for scanned records: the largest slot size that every record's offset fits, the
    slots the file holds of it, the median interval between consecutive records; the boot id is unknown."""
    slot_bytes = MAX_SLOT_BYTES
    while slot_bytes > MIN_SLOT_BYTES and (any((at - first) % slot_bytes for at, _ in found)
                                           or (size - first) // slot_bytes < max(2, len(found))):
        slot_bytes //= 2
    slots = min(MAX_SLOTS, max(2, (size - first) // slot_bytes))
    steps = sorted((b.time - a.time) / (b.seq - a.seq) for a, b in itertools.pairwise(records)
                   if b.time > a.time)
    interval = steps[len(steps) // 2] if steps else 0.0
    created = records[0].time if records else 0.0
    return RingHeader(boot_id=UNKNOWN_BOOT_ID, slots=slots, slot_bytes=slot_bytes, interval_seconds=interval,
                      created=created)


def read_ring(path: str | os.PathLike[str]) -> RingContents:
    """Every valid record of the ring file at `path` (no symlink followed). Raises OSError, RingFormatError."""
    fd = open_private(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        return read_ring_fd(fd)
    finally:
        os.close(fd)


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(f"pwrite returned {written} with {len(view)} bytes left")
        view, offset = view[written:], offset + written


def create_ring(path: Path, header: RingHeader, records: Sequence[tuple[int, bytes]] = ()) -> None:
    """Write a new ring file at `path` (replacing any): header, every slot zeroed, then `records`
    ((seq, encoded record) pairs) in their slots; written to a temporary file, fsynced, renamed, directory
    fsynced. On any failure (ENOSPC) the temporary file is removed and OSError raised."""
    tmp = temporary_name(path)
    fd = create_private(tmp, os.O_RDWR)
    try:
        try:
            write_all(fd, header.encode())
            zeros = bytes(min(1 << 20, header.slots * header.slot_bytes))
            left = header.slots * header.slot_bytes
            while left:
                chunk = zeros[:min(left, len(zeros))]
                write_all(fd, chunk)
                left -= len(chunk)
            for seq, data in records:
                pwrite_all(fd, data, header.slot_offset(seq))
            os.fsync(fd)
            if os.fstat(fd).st_size != header.file_bytes:
                raise OSError(f"{tmp}: size on disk is not the ring's {header.file_bytes} bytes")
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def slot_bytes_for(record_bytes: int) -> int:
    """The slot size for records of about `record_bytes`: twice that, rounded up to a power of two."""
    size = MIN_SLOT_BYTES
    while size < 2 * record_bytes and size < MAX_SLOT_BYTES:
        size *= 2
    return size


def slots_for(duration_seconds: float, interval_seconds: float) -> int:
    return max(2, math.ceil(duration_seconds / interval_seconds))


def new_header(boot_id: str, duration_seconds: float, interval_seconds: float, record_bytes: int) -> RingHeader:
    return RingHeader(boot_id=boot_id, slots=slots_for(duration_seconds, interval_seconds),
                      slot_bytes=slot_bytes_for(record_bytes), interval_seconds=interval_seconds, created=time.time())


class RingWriter:
    """An open ring file: `write(seq, record)` puts one encoded record into its slot and makes it durable."""

    def __init__(self, path: Path, sync: Callable[[int], None] = os.fdatasync) -> None:
        self.path = path
        self._sync = sync
        self.fd = open_private(path, os.O_RDWR)
        try:
            self.header = read_header(self.fd)
        except BaseException:
            os.close(self.fd)
            raise

    def fits(self, record: bytes) -> bool:
        return len(record) <= self.header.slot_bytes

    def write(self, seq: int, record: bytes) -> None:
        if not self.fits(record):
            raise ValueError(f"record of {len(record)} bytes does not fit a {self.header.slot_bytes}-byte slot")
        pwrite_all(self.fd, record, self.header.slot_offset(seq))
        self._sync(self.fd)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
