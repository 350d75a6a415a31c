"""A live allocator's state from a memory snapshot, a simulator seeded with it, and the state as
`torch.cuda.empty_cache()` would leave it (`released_cache`: the hook's "at best").

Input: the segment list `torch.cuda.memory_snapshot()` returns (a list, e.g. saved as JSON), or the
dict `torch.cuda.memory._snapshot()` returns and `_dump_snapshot()` pickles (its `segments`; its
`allocator_settings` give the process's allocator settings). PyTorch's format
(torch/csrc/cuda/Module.cpp, c10/cuda/CUDACachingAllocator.cpp `snapshot()`): per segment `device`,
`address`, `total_size`, `stream`, `segment_type` ("large" / "small"), `segment_pool_id` (the owning
private pool, (0, 0) for the default pools), `is_expandable` (then one entry per contiguous mapped
range) and `blocks` in address order, each with `size`, `state` ("active_allocated",
"active_pending_free", "inactive") and `address`.

What is modelled and what is refused (a `SnapshotError` naming it, exit 2 on the command line):
- one device: a snapshot of several devices needs `device=` (`--device`);
- one stream: default-pool segments on several streams are refused;
- private pools (CUDA graphs, `torch.cuda.MemPool`): their segments count in reserved and allocated
  bytes and keep their addresses, and nothing else: the simulated allocations use the default pools;
- "active_pending_free" blocks (freed, but used on another stream) are free, as they are once that
  stream's work is done; their bytes are reported;
- any other block state, or blocks that do not tile their segment, are refused.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeGuard

from telemetry.allocator_counters import AllocatorCounters
from telemetry.errors import ConfigError, shown
from telemetry.limits import MAX_SNAPSHOT_BLOCKS, MAX_SNAPSHOT_OBJECTS

from .config import SIZE_MAX, AllocatorConfig, AllocatorConfigError, format_alloc_conf, parse_alloc_conf, same_settings
from .simulator import LARGE_BUFFER, SMALL_BUFFER, CachingAllocatorSim
from .snapshot_file import DEFAULT_MAX_BYTES, objects_limit_error, read_snapshot_file

BLOCK_STATES = ("active_allocated", "active_pending_free", "inactive")
SEGMENT_TYPES = ("large", "small")
DEFAULT_POOL = (0, 0)


class SnapshotError(ConfigError):
    """A snapshot that is not one, or holds what the simulator does not model; the message says which."""


class _TooMany(Exception):
    """More segments and blocks than the object limit."""


@dataclass(frozen=True)
class SnapshotBlock:
    address: int
    size: int
    state: str

    @property
    def live(self) -> bool:
        return self.state == "active_allocated"


@dataclass(frozen=True)
class SnapshotSegment:
    address: int
    total_size: int
    small: bool
    expandable: bool
    stream: int
    pool_id: tuple[int, int]
    blocks: tuple[SnapshotBlock, ...]

    @property
    def allocated_bytes(self) -> int:
        return sum(b.size for b in self.blocks if b.live)


@dataclass(frozen=True)
class AllocatorState:
    """One device's caching-allocator state, read from a snapshot.

    segments: the default pools' segments (what a simulated allocation can use), by address.
    private_segments: segments of private pools (kept as reserved, allocated memory only).
    alloc_conf: the process's allocator settings as a `PYTORCH_CUDA_ALLOC_CONF` string, when the
        snapshot records them (a `_snapshot()` dict); None when it does not (a bare segment list).
    """

    device: int
    stream: int
    segments: tuple[SnapshotSegment, ...]
    private_segments: tuple[SnapshotSegment, ...] = ()
    alloc_conf: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def counters(self) -> AllocatorCounters:
        """Reserved and allocated bytes at the snapshot (event counts are not in a snapshot: 0)."""
        every = self.segments + self.private_segments
        return AllocatorCounters(sum(s.total_size for s in every), sum(s.allocated_bytes for s in every), 0, 0)

    @property
    def pending_free_bytes(self) -> int:
        return sum(b.size for s in self.segments for b in s.blocks if b.state == "active_pending_free")

    def live_blocks(self) -> int:
        return sum(1 for s in self.segments for b in s.blocks if b.live)


UINT64_END = 2**64  # addresses, sizes and stream handles are 64-bit unsigned in the allocator


def _uint64(value: Any, minimum: int = 0) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value < UINT64_END


def _int(value: Any, what: str, minimum: int = 0) -> int:
    if not _uint64(value, minimum):
        raise SnapshotError(f"{what} must be an integer from {minimum} below 2**64, got {shown(value)}")
    return value


def _segment(raw: Any, index: int, budget: list[int] | None = None) -> tuple[int, SnapshotSegment]:
    where = f"segment {index}"
    if not isinstance(raw, Mapping):
        raise SnapshotError(f"not a memory snapshot: {where} is a {type(raw).__name__}, expected a dict with "
                            "address, total_size, blocks, ...")
    for key in ("address", "total_size", "blocks"):
        if key not in raw:
            raise SnapshotError(f"{where}: no {key!r}; not a torch.cuda.memory_snapshot() segment")
    address = _int(raw["address"], f"{where}: address")
    total = _int(raw["total_size"], f"{where}: total_size", 1)
    where = f"segment {index} at {address:#x}"
    kind = raw.get("segment_type", "large" if total > 2 * 1024 * 1024 else "small")
    if kind not in SEGMENT_TYPES:
        raise SnapshotError(f"{where}: unknown segment_type {shown(kind)} (expected 'large' or 'small')")
    device = _int(raw.get("device", 0), f"{where}: device")
    stream = _int(raw.get("stream", 0), f"{where}: stream")
    pool = raw.get("segment_pool_id", DEFAULT_POOL)
    if not isinstance(pool, (tuple, list)) or len(pool) != 2:
        raise SnapshotError(f"{where}: segment_pool_id must be a pair of integers, got {shown(pool)}")
    pool_id = (_int(pool[0], f"{where}: segment_pool_id"), _int(pool[1], f"{where}: segment_pool_id"))
    expandable = raw.get("is_expandable", False)
    if not isinstance(expandable, bool):
        raise SnapshotError(f"{where}: is_expandable must be true or false, got {shown(expandable)}")
    raw_blocks = raw["blocks"]
    if not isinstance(raw_blocks, (list, tuple)) or not raw_blocks:
        raise SnapshotError(f"{where}: 'blocks' must be a non-empty list")
    if budget is not None:
        budget[0] -= len(raw_blocks) + 1
        if budget[0] < 0:
            raise _TooMany()
    blocks = []
    cursor = address
    for j, b in enumerate(raw_blocks):
        if not isinstance(b, Mapping) or "size" not in b or "state" not in b:
            raise SnapshotError(f"{where}, block {j}: expected a dict with size and state")
        size = _int(b["size"], f"{where}, block {j}: size", 1)
        state = b["state"]
        if state not in BLOCK_STATES:
            raise SnapshotError(f"{where}, block {j}: unknown block state {shown(state)} (the simulator knows "
                                f"{', '.join(BLOCK_STATES)})")
        block_address = b.get("address", cursor)
        if block_address != cursor:
            text = f"{block_address:#x}" if _uint64(block_address) else shown(block_address)
            raise SnapshotError(f"{where}, block {j}: address {text} where the blocks before it end at "
                                f"{cursor:#x}: blocks must tile the segment in address order")
        blocks.append(SnapshotBlock(cursor, size, state))
        cursor += size
    if cursor - address != total:
        raise SnapshotError(f"{where}: its blocks add up to {cursor - address} bytes, total_size is {total}")
    return device, SnapshotSegment(address, total, kind == "small", expandable, stream, pool_id, tuple(blocks))


def settings_alloc_conf(settings: Any) -> str | None:
    """The effective `PYTORCH_CUDA_ALLOC_CONF` of a snapshot's `allocator_settings` (None if absent)."""
    if not isinstance(settings, Mapping):
        return None
    text = settings.get("PYTORCH_CUDA_ALLOC_CONF", "")
    text = text if isinstance(text, str) else ""
    try:
        given = parse_alloc_conf(text)
    except AllocatorConfigError:
        given = AllocatorConfig()
    # The string is the last one parsed; the fields are what the allocator runs with.
    split = settings.get("max_split_size", given.max_split_size)
    threshold = settings.get("garbage_collection_threshold", given.garbage_collection_threshold)
    expandable = settings.get("expandable_segments", given.expandable_segments)
    expandable = expandable if isinstance(expandable, bool) else given.expandable_segments
    divisions = list(given.roundup_power2_divisions)
    raw = settings.get("roundup_power2_divisions")
    if isinstance(raw, Mapping):
        for key, value in raw.items():
            if isinstance(key, (str, int)) and len(str(key)) < 8 and str(key).isdigit() and isinstance(value, int) \
                    and 0 <= value < 2**16:
                index = int(key).bit_length() - 1
                if 0 <= index < len(divisions):
                    divisions[index] = value
    elif isinstance(raw, (list, tuple)) and len(raw) == len(divisions) and all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**16 for v in raw):
        divisions = [int(v) for v in raw]
    if not (isinstance(threshold, (int, float)) and not isinstance(threshold, bool) and 0 <= threshold <= 1):
        threshold = given.garbage_collection_threshold
    effective = AllocatorConfig(
        max_split_size=split if isinstance(split, int) and 0 < split < UINT64_END else SIZE_MAX,  # SIZE_MAX is -1
        max_non_split_rounding_size=given.max_non_split_rounding_size,
        garbage_collection_threshold=float(threshold),
        roundup_power2_divisions=tuple(divisions),
        expandable_segments=bool(expandable),
        per_process_memory_fraction=given.per_process_memory_fraction,
    )
    return text if same_settings(effective, given) else format_alloc_conf(effective)


def read_allocator_state(doc: Any, *, device: int | None = None, source: str = "snapshot",
                         pause: Callable[[], None] | None = None,
                         max_blocks: int = MAX_SNAPSHOT_BLOCKS) -> AllocatorState:
    """The allocator state in a snapshot document (a segment list, or a dict with `segments`).

    This is what the hook's forecast thread calls with `torch.cuda.memory_snapshot()` directly; `pause` is
    called after every segment (where the thread lets the serving threads run).
    """
    settings = None
    if isinstance(doc, Mapping):
        if "segments" not in doc:
            keys = ", ".join(sorted(map(str, doc)))[:200]
            raise SnapshotError(f"{source}: not a memory snapshot: a dict without 'segments' "
                                f"(it has {keys or 'no keys'})")
        settings = doc.get("allocator_settings")
        segments_raw = doc["segments"]
    else:
        segments_raw = doc
    if not isinstance(segments_raw, (list, tuple)):
        raise SnapshotError(f"{source}: not a memory snapshot: expected a list of segments, "
                            f"got {type(segments_raw).__name__}")
    by_device: dict[int, list[SnapshotSegment]] = {}
    budget = [max_blocks]  # segments and blocks, shared ones counted each time (they are read each time)
    too_many = objects_limit_error(source, max_blocks, "segments and blocks", "--max-blocks")
    if len(segments_raw) > max_blocks:
        raise SnapshotError(str(too_many))
    try:
        for index, raw in enumerate(segments_raw):
            dev, segment = _segment(raw, index, budget)
            by_device.setdefault(dev, []).append(segment)
            if pause is not None:
                pause()
    except SnapshotError as exc:
        raise SnapshotError(f"{source}: {exc}") from None
    except _TooMany:
        raise SnapshotError(str(too_many)) from None
    if device is None:
        if len(by_device) > 1:
            raise SnapshotError(f"{source}: segments of several devices ({', '.join(map(str, sorted(by_device)))}); "
                                "the simulator models one device: choose one with --device")
        device = next(iter(by_device), 0)
    elif by_device and device not in by_device:
        devices = ", ".join(map(str, sorted(by_device)))
        raise SnapshotError(f"{source}: no segments of device {device} (devices: {devices})")
    chosen = sorted(by_device.get(device, []), key=lambda s: s.address)
    default = tuple(s for s in chosen if s.pool_id == DEFAULT_POOL)
    private = tuple(s for s in chosen if s.pool_id != DEFAULT_POOL)
    streams = sorted({s.stream for s in default})
    if len(streams) > 1:
        shown = ", ".join(hex(s) for s in streams)
        raise SnapshotError(f"{source}: default-pool segments on several CUDA streams ({shown}); "
                            "the simulator models one stream")
    for previous, segment in itertools.pairwise(chosen):
        if segment.address < previous.address + previous.total_size:
            raise SnapshotError(f"{source}: segments at {previous.address:#x} and {segment.address:#x} overlap")
    notes = []
    if private:
        pools = sorted({s.pool_id for s in private})
        notes.append(f"{len(private)} segments ({sum(s.total_size for s in private):,} bytes) of {len(pools)} private "
                     "pools (CUDA graphs, MemPool) are kept as reserved memory; simulated allocations use the "
                     "default pools")
    pending = sum(b.size for s in default for b in s.blocks if b.state == "active_pending_free")
    if pending:
        notes.append(f"{pending:,} bytes of blocks freed but in use on another stream are taken as free")
    alloc_conf = settings_alloc_conf(settings) if settings is not None else None
    return AllocatorState(device, streams[0] if streams else 0, default, private, alloc_conf, tuple(notes))


def released_cache(state: AllocatorState) -> AllocatorState:
    """The state as `torch.cuda.empty_cache()` would leave it: every default-pool segment that holds no live block
    released, and under expandable segments every whole page of a free run unmapped (what c10's `release_blocks`
    does; CachingAllocatorSim.empty_cache is the same rule, on a running simulator). Live blocks stay where they
    are; private pools' segments stay (a pool's cache goes back only when the pool itself is freed). Blocks
    freed but still in use on another stream count as free, as empty_cache synchronizes their events first.
    The same object when nothing would be released."""
    kept: list[SnapshotSegment] = []
    for segment in state.segments:
        if segment.expandable:
            kept.extend(_unmapped_free_pages(segment))
        elif any(block.live for block in segment.blocks):
            kept.append(segment)
    if len(kept) == len(state.segments) and all(a is b for a, b in zip(kept, state.segments, strict=True)):
        return state
    return replace(state, segments=tuple(kept))


def _unmapped_free_pages(segment: SnapshotSegment) -> list[SnapshotSegment]:
    """One expandable mapped range with the whole pages of each free run unmapped: the mapped ranges left."""
    page = SMALL_BUFFER if segment.small else LARGE_BUFFER
    pieces: list[list[SnapshotBlock]] = [[]]   # the mapped ranges left, each a list of blocks
    run: list[SnapshotBlock] = []

    def end_run() -> None:
        if not run:
            return
        start, end = run[0].address, run[-1].address + run[-1].size
        first = start + -(start - segment.address) % page   # the first page boundary at or after the run
        last = end - (end - segment.address) % page          # the last page boundary at or before it
        if first >= last:                                    # no whole page: the run stays mapped as it was
            pieces[-1].extend(run)
        else:
            if first > start:
                pieces[-1].append(SnapshotBlock(start, first - start, "inactive"))
            pieces.append([])
            if end > last:
                pieces[-1].append(SnapshotBlock(last, end - last, "inactive"))
        run.clear()

    for block in segment.blocks:
        if block.live:
            end_run()
            pieces[-1].append(block)
        else:
            run.append(block)
    end_run()
    if len(pieces) == 1:
        return [segment]
    return [SnapshotSegment(blocks[0].address, sum(b.size for b in blocks), segment.small, True, segment.stream,
                            segment.pool_id, tuple(blocks)) for blocks in pieces if blocks]


def load_allocator_state(path: str | os.PathLike[str], *, device: int | None = None,
                         max_bytes: int = DEFAULT_MAX_BYTES, max_objects: int = MAX_SNAPSHOT_OBJECTS,
                         max_blocks: int = MAX_SNAPSHOT_BLOCKS) -> AllocatorState:
    """Read a snapshot file (JSON or data-only pickle, optionally gzip) into an AllocatorState."""
    return read_allocator_state(read_snapshot_file(path, max_bytes, max_objects), device=device, source=str(path),
                                max_blocks=max_blocks)


def seeded_simulator(state: AllocatorState, config: str | AllocatorConfig | None = None, *,
                     capacity_bytes: int | None = None, **hooks: Any) -> CachingAllocatorSim:
    """A simulator that starts where the snapshot's allocator was.

    config: the allocator settings to simulate; None: the snapshot's own (`state.alloc_conf`), else the defaults.
    The simulator's reserved and allocated bytes are the snapshot's (absolute, so a memory fraction
    or `capacity_bytes` applies as in the process); its event counters start at 0.
    """
    if config is None:
        config = state.alloc_conf or ""
    try:
        sim = CachingAllocatorSim(config, capacity_bytes=capacity_bytes, **hooks)
    except AllocatorConfigError as exc:
        raise SnapshotError(str(exc)) from None
    segments = [(s.address, s.small, s.expandable, [(b.size, b.live) for b in s.blocks]) for s in state.segments]
    opaque = [(s.address, s.total_size, s.allocated_bytes) for s in state.private_segments]
    try:
        sim.seed(segments, opaque)
    except ValueError as exc:
        raise SnapshotError(f"cannot start the simulator from this snapshot: {exc}") from None
    return sim


__all__ = ["BLOCK_STATES", "UINT64_END", "AllocatorState", "SnapshotBlock", "SnapshotError", "SnapshotSegment",
           "load_allocator_state", "read_allocator_state", "released_cache", "seeded_simulator", "shown"]
