"""A process's allocation history, and the allocator state it leaves under another setting: what `memtel tune`
replays so that each setting starts from the state a restarted process would really have.

A snapshot is one allocator's state, the result of its settings applied to the process's allocations and frees.
Under another setting the same allocations leave another state: an expandable segment keeps the free pages its
history left inside it, a `max_split_size_mb` keeps large blocks whole, a garbage-collection threshold frees
cached blocks on the way. Rebuilding that state from the snapshot's live blocks alone gives a best case (no free
memory trapped by the history). So the history itself is replayed, op by op, on a simulator under each setting.

The history is a sequence of ops: ``("a", id, nbytes)`` an allocation of `nbytes` (requested), ``("f", id)`` its
free, ``("e",)`` a `torch.cuda.empty_cache()`. Sources:

- a JSON list of ``["a", id, bytes]`` / ``["f", id]`` (shared/data/tune-truth's `history_*.json`);
- a `torch.cuda.memory._dump_snapshot()` pickle recorded with `_record_memory_history()` from the process's
  start: its `alloc` and `free_completed` events (trace.py); a trace that frees what it never allocated lost
  its start (the ring of `max_entries`) and is refused;
- the hook's `/snapshot` with the history it kept (`{"history": [...]}` beside the segments).

Only the allocator settings change in the replay: the ops are the process's as recorded (a prefill it ran keeps
the chunk and budget it ran with), and the settings apply from the process's start.

Refused with one line (HistoryError, exit 2): more than `max_ops` ops, an op that is not one of the two forms, an
allocation of an id that is live, a free of an id that is not (out of order), and a history whose live
allocations at its end are not the snapshot's live blocks (another process, or another moment).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from telemetry.errors import ConfigError, shown
from telemetry.model.allocsim.config import AllocatorConfig, parse_alloc_conf
from telemetry.model.allocsim.simulator import SMALL_SIZE, CachingAllocatorSim, SimulatedOutOfMemoryError, round_size
from telemetry.model.allocsim.snapshot import AllocatorState, read_allocator_state
from telemetry.model.allocsim.snapshot_file import read_snapshot_file
from telemetry.model.allocsim.trace import read_trace

MAX_HISTORY_OPS = 2_000_000   # ops replayed per setting; about 1 s of CPU per million ops and setting
Op = tuple[str, int, int]     # ("a", id, nbytes), ("f", id, 0) or ("e", 0, 0): torch.cuda.empty_cache()


class HistoryError(ConfigError):
    """A history that is not one, is out of order, is too long, or does not lead to the snapshot."""


@dataclass(frozen=True)
class History:
    """The ops in order; `source` names where they came from (for messages)."""

    ops: tuple[Op, ...]
    source: str = "history"

    @property
    def allocations(self) -> int:
        return sum(1 for op in self.ops if op[0] == "a")


def _uint(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**63


def history_from_ops(entries: Any, *, source: str = "history", max_ops: int = MAX_HISTORY_OPS) -> History:
    """Check a list of ``["a", id, bytes]`` / ``["f", id]`` entries (module docstring) into a History."""
    if not isinstance(entries, (list, tuple)):
        raise HistoryError(f"{source}: expected a list of [\"a\", id, bytes] and [\"f\", id] entries, got a "
                           f"{type(entries).__name__}")
    if len(entries) > max_ops:
        raise HistoryError(f"{source}: {len(entries):,} ops, more than the bound of {max_ops:,}; keep the history "
                           "compacted (the hook does), or raise --max-history-ops")
    live: set[int] = set()
    ops: list[Op] = []
    for index, entry in enumerate(entries):
        kind = entry[0] if isinstance(entry, (list, tuple)) and entry else None
        if kind == "a" and len(entry) == 3 and _uint(entry[1]) and _uint(entry[2]):
            if entry[1] in live:
                raise HistoryError(f"{source}: op {index} {shown(entry)}: allocates id {entry[1]}, which is live "
                                   "(ops out of order, or ids reused before their free)")
            live.add(entry[1])
            ops.append(("a", entry[1], entry[2]))
        elif kind == "e" and len(entry) == 1:   # torch.cuda.empty_cache()
            ops.append(("e", 0, 0))
        elif kind == "f" and len(entry) == 2 and _uint(entry[1]):
            if entry[1] not in live:
                raise HistoryError(f"{source}: op {index} {shown(entry)}: frees id {entry[1]}, which is not live "
                                   "(ops out of order, or a history that lost its start)")
            live.discard(entry[1])
            ops.append(("f", entry[1], 0))
        else:
            raise HistoryError(f"{source}: op {index} {shown(entry)}: expected [\"a\", id, bytes], [\"f\", id] "
                               "with non-negative integers, or [\"e\"]")
    return History(tuple(ops), source)


def history_from_trace(doc: Mapping[str, Any], *, device: int | None = None, source: str = "trace",
                       max_ops: int = MAX_HISTORY_OPS) -> History:
    """The ops of a recorded memory history (`_dump_snapshot()` after `_record_memory_history()`): its allocations
    and frees, and its `empty_cache()` calls as `memtel whatif` infers them (device frees no allocation caused;
    telemetry/model/allocsim/whatif.py)."""
    from telemetry.model.allocsim.whatif import OP_ALLOC, OP_EMPTY_CACHE, OP_FREE, plan_trace

    trace = read_trace(doc, device=device, source=source, max_objects=max_ops)
    effective = parse_alloc_conf(trace.effective_conf)
    collects = effective.garbage_collection_threshold > 0 and effective.per_process_memory_fraction is not None
    plan = plan_trace(trace, collects, trace.effective_conf)
    if plan.unknown_frees or plan.unknown_segment_frees:
        raise HistoryError(f"{source}: frees of blocks or segments the history never allocated: it lost its start "
                           "(the ring of max_entries, or recording began late); record from the process's start "
                           "with a larger max_entries")
    if plan.reused_live_addresses:
        raise HistoryError(f"{source}: allocations at addresses that are live (entries out of order)")
    ids: dict[int, int] = {}
    ops: list[Op] = []
    for code, addr, size in plan.ops:
        if code == OP_ALLOC:
            ids[addr] = len(ops)
            ops.append(("a", len(ops), size))
        elif code == OP_FREE:
            ops.append(("f", ids.pop(addr), 0))
        elif code == OP_EMPTY_CACHE:
            ops.append(("e", 0, 0))
    if len(ops) > max_ops:
        raise HistoryError(f"{source}: {len(ops):,} ops, more than the bound of {max_ops:,}")
    return History(tuple(ops), source)


def read_history(doc: Any, *, device: int | None = None, source: str = "history",
                 max_ops: int = MAX_HISTORY_OPS) -> History:
    """A History from any of the module's sources, as a parsed document."""
    if isinstance(doc, Mapping) and "device_traces" in doc:
        return history_from_trace(doc, device=device, source=source, max_ops=max_ops)
    if isinstance(doc, Mapping) and "history" in doc:
        return history_from_ops(doc["history"], source=source, max_ops=max_ops)
    return history_from_ops(doc, source=source, max_ops=max_ops)


def load_history(path: str | os.PathLike[str], *, device: int | None = None, max_bytes: int,
                 max_ops: int = MAX_HISTORY_OPS) -> History:
    # every op is a container while the file is read: allow them, and a little for the document around them
    doc = read_snapshot_file(path, max_bytes, max_ops + 1000)
    return read_history(doc, device=device, source=str(path), max_ops=max_ops)


def live_sizes(history: History) -> list[int]:
    """The requested bytes of the allocations live at the history's end."""
    live: dict[int, int] = {}
    for kind, ident, nbytes in history.ops:
        if kind == "a":
            live[ident] = nbytes
        elif kind == "f":
            del live[ident]
    return [n for n in live.values() if n]


def check_matches(history: History, state: AllocatorState, alloc_conf: str) -> None:
    """HistoryError unless the history's live allocations are the snapshot's live blocks: as many, and each
    block its allocation's size as the allocator rounds it (`alloc_conf`, the process's settings), or up to a
    remainder the allocator does not split off (up to 1 MiB in the large pool, or max_non_split_rounding_mb's
    for an oversize block; none in the small)."""
    conf = parse_alloc_conf(alloc_conf)
    wanted = sorted(round_size(n, conf) for n in live_sizes(history))
    blocks = sorted(b.size for s in state.segments for b in s.blocks if b.live)
    if len(wanted) != len(blocks):
        raise HistoryError(f"{history.source}: {len(wanted):,} allocations live at its end, the snapshot holds "
                           f"{len(blocks):,} live blocks: the history is not this process's up to this snapshot")
    slack = max(SMALL_SIZE, conf.max_non_split_rounding_size)   # a large block's unsplit rest, at most
    for size, block in zip(wanted, blocks, strict=True):
        if not size <= block <= size + (slack if size > SMALL_SIZE else 0):
            raise HistoryError(f"{history.source}: its live allocations are not the snapshot's live blocks (an "
                               f"allocation of {size:,} bytes against a block of {block:,}): the history is not "
                               "this process's up to this snapshot")


def replay(history: History, config: str | AllocatorConfig, *, capacity_bytes: int | None = None,
           total_memory: int | None = None, device: int = 0) -> AllocatorState:
    """The state `history` leaves on an allocator that ran under `config` from its start (within the limits).

    Raises SimulatedOutOfMemoryError where the history itself does not fit under this setting."""
    sim = CachingAllocatorSim(config, capacity_bytes=capacity_bytes, total_memory=total_memory)
    handles: dict[int, int] = {}
    malloc, free = sim.malloc, sim.free
    for kind, ident, nbytes in history.ops:
        if kind == "a":
            handles[ident] = malloc(nbytes)
        elif kind == "f":
            free(handles.pop(ident))
        else:
            sim.empty_cache()
    state = read_allocator_state(sim.snapshot(device), device=device, source=f"{history.source} replayed",
                                 max_blocks=2**62)
    return dataclasses.replace(state, alloc_conf=config if isinstance(config, str) else None)


__all__ = ["MAX_HISTORY_OPS", "History", "HistoryError", "SimulatedOutOfMemoryError", "check_matches",
           "history_from_ops", "history_from_trace", "live_sizes", "load_history", "read_history", "replay"]
