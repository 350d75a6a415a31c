"""The allocator's event log's bytes (snapshot_native.cpp `take_events()` writes them) and back to records.

FORMAT, little-endian, fixed widths:
- header, 16 bytes: magic b"MTAE", format version (u16, 1), flags (u16: 1 overflowed, events were dropped since the
  last take; 2 this torch's trace entries carry no memory pool id), records (u32), 0 (u32);
- per record, 48 bytes: action (u8, c10's TraceEntry::Action: `ACTIONS`), 0 (u8), device (i16), 0 (u32), address,
  size, stream (the `cudaStream_t`'s bits), the memory pool's id (two u64), all u64. A SNAPSHOT record is the
  extension's own snapshot passing that point: its device is the index of the device allocator in that snapshot
  (one per device, in device order); other readers' snapshots leave none.

Bytes that are not this format (cut short, too long, an unknown version, flag or action, non-zero padding, more
records than `MAX_EVENTS`) raise `EventBytesError` naming what is wrong. Pure Python, for the helper process.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import NamedTuple

from telemetry.hook.forecast.snapshot_native.codec import SnapshotBytesError, read_header
from telemetry.model.allocsim.trace import ACTION_NAMES

MAGIC = b"MTAE"
EVENTS_VERSION = 1
HEADER = struct.Struct("<4sHHII")
RECORD = struct.Struct("<BBhIQQQQQ")
OVERFLOWED, NO_POOL = 1, 2
MAX_EVENTS = 1 << 22   # the extension's default cap between two takes (4,194,304 records, 192 MiB of bytes)


class EventBytesError(SnapshotBytesError):
    """Bytes that are not the allocator's event log; the message says what is wrong."""


class Event(NamedTuple):
    action: int
    device: int
    addr: int
    size: int
    stream: int
    pool: tuple[int, int]


class EventLog(NamedTuple):
    events: list[Event]
    overflowed: bool   # events were dropped: what came after the last take is not all here
    no_pool: bool      # the records cannot tell a private pool's events from the default pools'


def decode_events(data: bytes, *, max_events: int = MAX_EVENTS) -> EventLog:
    view, (_, version, flags, count, zero) = read_header(data, HEADER, MAGIC, "an allocator event log",
                                                         EventBytesError)
    if version != EVENTS_VERSION or zero:
        raise EventBytesError(f"allocator event log format {version} (padding {zero:#x}): this memtel reads "
                              f"{EVENTS_VERSION} (rebuild the extension: docs/hook.md, 'Live forecast')")
    if flags & ~(OVERFLOWED | NO_POOL):
        raise EventBytesError(f"allocator event log: unknown flags {flags:#x}")
    if count > max_events:
        raise EventBytesError(f"an allocator event log of {count:,} records is over the {max_events:,}-record bound")
    expected = HEADER.size + RECORD.size * count
    if len(view) != expected:
        raise EventBytesError(f"an allocator event log of {count:,} records takes {expected:,} bytes, got "
                              f"{len(view):,}")
    events = []
    for index, (action, pad0, device, pad1, addr, size, stream, pool0, pool1) in enumerate(
            RECORD.iter_unpack(view[HEADER.size:])):
        if action not in ACTION_NAMES or pad0 or pad1:   # c10's TraceEntry::Action codes (trace.py names them)
            raise EventBytesError(f"allocator event log, record {index}: unknown action {action} or padding "
                                  f"{pad0:#x}/{pad1:#x} (known actions: {', '.join(ACTION_NAMES.values())})")
        events.append(Event(action, device, addr, size, stream, (pool0, pool1)))
    return EventLog(events, bool(flags & OVERFLOWED), bool(flags & NO_POOL))


def unchanged(data: bytes) -> bool:
    """Whether an event log's bytes say nothing happened: no record, none dropped."""
    return len(data) == HEADER.size and data[:4] == MAGIC and data[6:8] == b"\0\0"


def encode_events(events: Iterable[Event | tuple[int, int, int, int, int, tuple[int, int]]], *,
                  overflowed: bool = False, no_pool: bool = False) -> bytes:
    """The bytes the extension writes for these events: for tests and tools that make them without it."""
    records = [RECORD.pack(e[0], 0, e[1], 0, e[2], e[3], e[4], e[5][0], e[5][1]) for e in events]
    flags = (OVERFLOWED if overflowed else 0) | (NO_POOL if no_pool else 0)
    return HEADER.pack(MAGIC, EVENTS_VERSION, flags, len(records), 0) + b"".join(records)


__all__ = ["EVENTS_VERSION", "Event", "EventBytesError", "EventLog", "decode_events", "encode_events",
           "unchanged"]
