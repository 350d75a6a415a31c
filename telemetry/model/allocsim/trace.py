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
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .snapshot import AllocatorState, SnapshotError, read_allocator_state, settings_alloc_conf
from .snapshot_file import DEFAULT_MAX_BYTES, read_snapshot_file

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
    shown = entry
    if isinstance(entry, Mapping):
        shown = {k: entry[k] for k in ("action", "addr", "size", "stream") if k in entry}
    return TraceError(f"{source}: trace entry {index} {shown!r}: {problem}")


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
        if type(addr) is not int or type(size) is not int or type(stream) is not int or size < 0:
            raise _bad(source, index, entry, "addr, size and stream must be integers (size >= 0)")
        streams.add(stream)
        if pool is not None:
            pools.add((int(pool[0]), int(pool[1])))
        append((code, addr, size))
    return events, streams, pools


def read_trace(doc: Any, *, device: int | None = None, source: str = "trace") -> MemoryTrace:
    """The recorded history of one device in a `_snapshot()` document."""
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
    events, streams, pools = _events(list(traces[device]), source)
    if len(streams) > 1:
        raise TraceError(f"{source}: a trace from several CUDA streams ({', '.join(hex(s) for s in sorted(streams))}); "
                         "the replay models one stream")
    private = sorted(p for p in pools if p != (0, 0))
    if private:
        raise TraceError(f"{source}: allocations in private memory pools {private} (CUDA graphs, MemPool); "
                         "the replay models the default pools only")
    try:
        final = read_allocator_state({"segments": doc.get("segments", [])}, device=device, source=source)
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
               max_bytes: int = DEFAULT_MAX_BYTES) -> MemoryTrace:
    return read_trace(read_snapshot_file(path, max_bytes), device=device, source=str(path))


__all__ = ["ACTION_CODES", "ACTION_NAMES", "Event", "MemoryTrace", "TraceError", "load_trace", "read_trace"]
