"""The native snapshot's bytes (snapshot_native.cpp writes them) and back to `torch.cuda.memory_snapshot()`'s segments.

FORMAT, little-endian, fixed widths:
- header, 16 bytes: magic b"MTAS", format version (u16, 1), 0 (u16), segments (u32), blocks in all (u32);
- per segment, 56 bytes: device (i32), flags (u32: 1 large pool, 2 expandable), address, total_size, stream
  (the `cudaStream_t`'s bits), the owning private pool's id (two u64, (0, 0) for the default pools), all u64;
  its blocks (u32), 0 (u32); then its blocks, 16 bytes each: size (u64), state (u8: 0 inactive,
  1 active_allocated, 2 active_pending_free), 7 bytes of 0.

What is kept is what `telemetry.model.allocsim.snapshot.read_allocator_state` reads (a block's address is the
segment's plus the blocks before it, as torch computes it); `decode_snapshot` gives it back in torch's format, so
the simulator reads one format from either reader. Bytes that are not this format (cut short, too long, counts
that disagree, an unknown state or flag, more objects than `MAX_SNAPSHOT_BLOCKS`) raise `SnapshotBytesError`
naming what is wrong. Pure Python: the forecast's helper process decodes without torch.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

from telemetry.limits import MAX_SNAPSHOT_BLOCKS

MAGIC = b"MTAS"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sHHII")
SEGMENT = struct.Struct("<iIQQQQQII")
BLOCK = struct.Struct("<QB7x")
LARGE, EXPANDABLE = 1, 2
STATES = ("inactive", "active_allocated", "active_pending_free")


class SnapshotBytesError(ValueError):
    """Bytes that are not a native allocator snapshot; the message says what is wrong."""


def read_header(data: object, header: struct.Struct, magic: bytes, what: str,
                error: type[SnapshotBytesError]) -> tuple[memoryview, tuple[Any, ...]]:
    """The bytes and their header's fields, after the checks the extension's formats share: bytes, long enough
    for the header, the magic first. `what` names the format with its article ("a native allocator snapshot")."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise error(f"{what} is bytes, got {type(data).__name__}")
    view = memoryview(data)
    if len(view) < header.size:
        raise error(f"{what} of {len(view)} bytes is shorter than its {header.size}-byte header")
    fields = header.unpack_from(view, 0)
    if fields[0] != magic:
        raise error(f"not {what}: it starts with {bytes(fields[0])!r}, not {magic!r}")
    return view, fields


def decode_snapshot(data: bytes, *, max_objects: int = MAX_SNAPSHOT_BLOCKS) -> list[dict[str, Any]]:
    """The segments as `torch.cuda.memory_snapshot()` lists them (the keys the simulator reads)."""
    view, (_, version, zero, segments, blocks) = read_header(data, HEADER, MAGIC, "a native allocator snapshot",
                                                             SnapshotBytesError)
    if version != FORMAT_VERSION or zero:
        raise SnapshotBytesError(f"native allocator snapshot format {version}.{zero}: this memtel reads "
                                 f"{FORMAT_VERSION}.0 (rebuild the extension: docs/hook.md, 'Live forecast')")
    if segments + blocks > max_objects:
        raise SnapshotBytesError(f"a native allocator snapshot of {segments:,} segments and {blocks:,} blocks is "
                                 f"over the {max_objects:,}-object bound")
    expected = HEADER.size + SEGMENT.size * segments + BLOCK.size * blocks
    if len(view) != expected:
        raise SnapshotBytesError(f"a native allocator snapshot of {segments:,} segments and {blocks:,} blocks takes "
                                 f"{expected:,} bytes, got {len(view):,}")
    out: list[dict[str, Any]] = []
    offset, left = HEADER.size, blocks
    for index in range(segments):
        device, flags, address, total, stream, pool0, pool1, count, pad = SEGMENT.unpack_from(view, offset)
        offset += SEGMENT.size
        if flags & ~(LARGE | EXPANDABLE) or pad:
            raise SnapshotBytesError(f"native allocator snapshot, segment {index}: unknown flags {flags:#x} or "
                                     f"padding {pad:#x}")
        if count > left:
            raise SnapshotBytesError(f"native allocator snapshot, segment {index}: {count:,} blocks where the header "
                                     f"leaves {left:,}")
        left -= count
        cursor = address
        segment_blocks = []
        for j in range(count):
            size, state = BLOCK.unpack_from(view, offset)
            offset += BLOCK.size
            if state >= len(STATES):
                raise SnapshotBytesError(f"native allocator snapshot, segment {index}, block {j}: unknown state "
                                         f"{state}")
            segment_blocks.append({"address": cursor, "size": size, "state": STATES[state]})
            cursor += size
        out.append({"device": device, "address": address, "total_size": total, "stream": stream,
                    "segment_type": "large" if flags & LARGE else "small", "segment_pool_id": (pool0, pool1),
                    "is_expandable": bool(flags & EXPANDABLE), "blocks": segment_blocks})
    if left:
        raise SnapshotBytesError(f"native allocator snapshot: the header counts {blocks:,} blocks, its segments "
                                 f"{blocks - left:,}")
    return out


def encode_snapshot(segments: Sequence[Mapping[str, Any]]) -> bytes:
    """The bytes the native reader writes for these segments (torch's format): for tests and tools that make
    them without the extension. ValueError (struct.error) for a value out of its field's range."""
    parts = [HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(segments), sum(len(s["blocks"]) for s in segments))]
    for s in segments:
        flags = (LARGE if s.get("segment_type", "large") == "large" else 0) | (EXPANDABLE if s.get("is_expandable")
                                                                               else 0)
        pool = s.get("segment_pool_id", (0, 0))
        parts.append(SEGMENT.pack(s.get("device", 0), flags, s["address"], s["total_size"], s.get("stream", 0),
                                  pool[0], pool[1], len(s["blocks"]), 0))
        parts += [BLOCK.pack(b["size"], STATES.index(b["state"])) for b in s["blocks"]]
    return b"".join(parts)


def torch_fields(segments: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`torch.cuda.memory_snapshot()`'s segments cut to the keys the native reader keeps (what decode gives)."""
    keys = ("device", "address", "total_size", "stream", "segment_type", "segment_pool_id", "is_expandable")
    return [{**{k: (tuple(s[k]) if k == "segment_pool_id" else s[k]) for k in keys},
             "blocks": [{"address": b["address"], "size": b["size"], "state": b["state"]} for b in s["blocks"]]}
            for s in segments]


__all__ = ["FORMAT_VERSION", "MAGIC", "SnapshotBytesError", "decode_snapshot", "encode_snapshot", "torch_fields"]
