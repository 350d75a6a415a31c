"""The allocation history in a `torch.cuda.memory._dump_snapshot()` pickle, as compact events.

After `torch.cuda.memory._record_memory_history()`, `_snapshot()` holds `device_traces`: per device,
the allocator's own log in order (c10/cuda/CUDACachingAllocator.cpp `record_trace`):

- `alloc` (addr, size = the requested bytes), `free_requested` and `free_completed` (addr): a
  tensor's block handed out and given back (completed once other streams are done with it);
- `segment_alloc` / `segment_free` (cudaMalloc / cudaFree) and `segment_map` / `segment_unmap`
  (pages of an expandable segment): the allocator's calls to the device;
- `snapshot` (a snapshot was taken: the points users mark), `oom` (a malloc failed; size = the
  rounded request), `user_defined` (annotations, ignored).

The log is a ring of `max_entries` (unbounded by default): when it wraps, its start is gone.
`allocator_settings` holds the settings the process ran with, `segments` the state at the dump.

Every field read is checked (an integer from 0 below 2**64 for addr, size, stream and an OOM's
device_free; pool_id a pair of such integers), and at most `max_objects` entries are read
(`--max-objects`; the file's own limits: snapshot_file.py): anything else is one line naming the entry.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from telemetry.limits import MAX_SNAPSHOT_BLOCKS, MAX_SNAPSHOT_OBJECTS

from .snapshot import UINT64_END, AllocatorState, SnapshotError, read_allocator_state, settings_alloc_conf, shown
from .snapshot_file import DEFAULT_MAX_BYTES, objects_limit_error, read_snapshot_file

ALLOC, FREE_REQUESTED, FREE_COMPLETED, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP, SNAPSHOT, OOM = range(9)
ACTION_CODES = {
    "alloc": ALLOC,
    "free_requested": FREE_REQUESTED,
    "free_completed": FREE_COMPLETED,
    "segment_alloc": SEGMENT_ALLOC,
    "segment_free": SEGMENT_FREE,
    "segment_map": SEGMENT_MAP,
    "segment_unmap": SEGMENT_UNMAP,
    "snapshot": SNAPSHOT,
    "oom": OOM,
}
ACTION_NAMES = {code: name for name, code in ACTION_CODES.items()}
# The device calls, by what they do to reserved memory: a new segment or mapped pages, and their release.
GROW = {code: ACTION_NAMES[code] for code in (SEGMENT_ALLOC, SEGMENT_MAP)}
SHRINK = {code: ACTION_NAMES[code] for code in (SEGMENT_FREE, SEGMENT_UNMAP)}
IGNORED_ACTIONS = frozenset({"user_defined"})
Event = tuple[int, int, int]  # (action code, address, size)


class TraceError(SnapshotError):
    """A file that is not a recorded memory history, or one the replay does not model."""


@dataclass
class MemoryTrace:
    """One device's recorded allocator history.

    recorded_conf: `allocator_settings["PYTORCH_CUDA_ALLOC_CONF"]` as recorded ("" when absent).
    effective_conf: the settings the allocator ran with (from the recorded fields), as a string.
    final: the allocator's state when the snapshot was dumped (its `segments`).
    """

    device: int
    stream: int
    events: list[Event]
    recorded_conf: str = ""
    effective_conf: str = ""
    has_settings: bool = False
    final: AllocatorState | None = None
    notes: list[str] = field(default_factory=list)


def _bad(source: str, index: int, entry: Any, problem: str) -> TraceError:
    if isinstance(entry, Mapping):
        text = "{" + ", ".join(f"{k!r}: {shown(entry[k], 40)}" for k in ("action", "addr", "size", "stream", "pool_id")
                               if k in entry) + "}"
    else:
        text = shown(entry)
    return TraceError(f"{source}: trace entry {index} {text}: {problem}")


def _uint64(value: Any) -> bool:
    return type(value) is int and 0 <= value < UINT64_END


def _events(entries: list[Any], source: str) -> tuple[list[Event], set[int], set[tuple[int, int]]]:
    events: list[Event] = []
    append = events.append
    streams: set[int] = set()
    pools: set[tuple[int, int]] = set()
    codes = ACTION_CODES
    for index, entry in enumerate(entries):
        try:
            action = entry["action"]
            code = codes.get(action)
            if code is None:
                if action in IGNORED_ACTIONS:
                    continue
                raise _bad(source, index, entry, f"unknown action {action!r} (known: {', '.join(codes)})")
            if code == SNAPSHOT:  # recorded with address 0 and stream 0 whatever the workload's stream
                append((SNAPSHOT, 0, 0))
                continue
            addr = entry["device_free"] if code == OOM else entry["addr"]
            size = entry["size"]
            stream = entry.get("stream", 0)
            pool = entry.get("pool_id")
        except (KeyError, TypeError):
            raise _bad(source, index, entry, "expected a dict with action, addr, size and stream") from None
        if not (_uint64(addr) and _uint64(size) and _uint64(stream)):
            raise _bad(source, index, entry, "addr, size and stream must be integers from 0 below 2**64")
        streams.add(stream)
        if pool is not None:
            if not (isinstance(pool, (list, tuple)) and len(pool) == 2 and _uint64(pool[0]) and _uint64(pool[1])):
                raise _bad(source, index, entry, "pool_id must be a pair of integers (the memory pool's id)")
            pools.add((pool[0], pool[1]))
        append((code, addr, size))
    return events, streams, pools


def read_trace(doc: Any, *, device: int | None = None, source: str = "trace",
               max_objects: int = MAX_SNAPSHOT_OBJECTS, max_blocks: int = MAX_SNAPSHOT_BLOCKS) -> MemoryTrace:
    """The recorded history of one device in a `_snapshot()` document (at most `max_objects` entries)."""
    if not isinstance(doc, Mapping) or "device_traces" not in doc:
        what = "a dict without 'device_traces'" if isinstance(doc, Mapping) else f"a {type(doc).__name__}"
        raise TraceError(f"{source}: not a recorded memory history ({what}); expected the pickle "
                         "torch.cuda.memory._dump_snapshot() writes after torch.cuda.memory._record_memory_history()")
    traces = doc["device_traces"]
    if not isinstance(traces, (list, tuple)) or not all(isinstance(t, (list, tuple)) for t in traces):
        raise TraceError(f"{source}: 'device_traces' must be a list of per-device lists of trace entries")
    recorded = [i for i, t in enumerate(traces) if t]
    if device is None:
        if len(recorded) > 1:
            raise TraceError(f"{source}: histories of several devices ({', '.join(map(str, recorded))}); "
                             "the replay models one device: choose one with --device")
        if not recorded:
            raise TraceError(f"{source}: the history is empty; record it with "
                             "torch.cuda.memory._record_memory_history() before the workload runs")
        device = recorded[0]
    elif device >= len(traces) or not traces[device]:
        raise TraceError(f"{source}: no history of device {device} (devices with one: "
                         f"{', '.join(map(str, recorded)) or 'none'})")
    if len(traces[device]) > max_objects:
        raise TraceError(str(objects_limit_error(source, max_objects)))
    events, streams, pools = _events(list(traces[device]), source)
    if len(streams) > 1:
        raise TraceError(f"{source}: a trace from several CUDA streams ({', '.join(hex(s) for s in sorted(streams))}); "
                         "the replay models one stream")
    private = sorted(p for p in pools if p != (0, 0))
    if private:
        raise TraceError(f"{source}: allocations in private memory pools {private} (CUDA graphs, MemPool); "
                         "the replay models the default pools only")
    try:
        final = read_allocator_state({"segments": doc.get("segments", [])}, device=device, source=source,
                                     max_blocks=max_blocks)
    except SnapshotError as exc:
        raise TraceError(str(exc)) from None
    if final.private_segments:
        raise TraceError(f"{source}: the process holds {len(final.private_segments)} segments of private memory pools "
                         "(CUDA graphs, MemPool), whose allocations the trace does not tell apart; "
                         "the replay models the default pools only")
    settings = doc.get("allocator_settings")
    trace = MemoryTrace(device, next(iter(streams), 0), events, final=final)
    if isinstance(settings, Mapping):
        trace.has_settings = True
        recorded_conf = settings.get("PYTORCH_CUDA_ALLOC_CONF", "")
        trace.recorded_conf = recorded_conf if isinstance(recorded_conf, str) else ""
        trace.effective_conf = settings_alloc_conf(settings) or ""
    else:
        trace.notes.append("the file records no allocator settings (an older torch): the recorded run is taken "
                           "to have used the defaults")
    return trace


def load_trace(path: str | os.PathLike[str], *, device: int | None = None,
               max_bytes: int = DEFAULT_MAX_BYTES, max_objects: int = MAX_SNAPSHOT_OBJECTS,
               max_blocks: int = MAX_SNAPSHOT_BLOCKS) -> MemoryTrace:
    return read_trace(read_snapshot_file(path, max_bytes, max_objects), device=device, source=str(path),
                      max_objects=max_objects, max_blocks=max_blocks)


__all__ = ["ACTION_CODES", "ACTION_NAMES", "GROW", "SHRINK", "Event", "MemoryTrace", "TraceError", "load_trace",
           "read_trace"]
