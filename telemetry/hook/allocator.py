"""The allocator read after each hooked call: `AllocatorCounters` from one source per process.

The default source is the CUDA caching allocator read through torch's nested statistics binding,
`torch._C._cuda_memoryStats(device)` (what `torch.cuda.memory_stats` calls before it flattens and
sorts all keys): one C++ call returns every counter, about 10 us on an H200 against 80-140 us for
`memory_stats()` / `memory_reserved()`. A torch without that private binding is read through the
public `torch.cuda.memory_stats()`: slower, but the same counters; the hook says so once in its log
and in `memtel_hook_allocator_reader_info{reader}`. The lab server replaces the source with its
simulator through `set_allocator_source` (docs/architecture.md, "Allocator source").

The live forecast's thread (telemetry/hook/forecast) also asks the reader for the allocator's segments,
`snapshot()`: `torch.cuda.memory_snapshot()` for CUDA, the source's `snapshot` callable otherwise. Never
on the hooked call's path.

torch is never imported here: a process that has not imported torch has no allocator to read.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from telemetry.allocator_counters import FIELDS, AllocatorCounters
from telemetry.catalogue import metrics as catalogue
from telemetry.errors import ConfigError

log = logging.getLogger("memtel.hook")

NESTED_BINDING = "torch._C._cuda_memoryStats"
PUBLIC_MEMORY_STATS = "torch.cuda.memory_stats"
ALLOCATOR_SOURCE = "allocator_source"

# Builds the named tuple from a plain tuple without its Python-level __new__ (the hot path's share).
_new_counters = tuple.__new__


class CudaAllocatorReader:
    """Reads the CUDA caching allocator of the current device; None where there is none (yet)."""

    def __init__(self) -> None:
        self._binding: Callable[[int], Any] | None = None
        self._public = False   # reading through torch.cuda.memory_stats (the binding is missing)
        self._device = 0
        self._torch: Any = None
        self.device = "cpu"             # "cuda:N" once bound (the record's `device`)
        self.kind: str | None = None    # which reader (NESTED_BINDING or PUBLIC_MEMORY_STATS) once bound
        self._last: tuple[tuple[Any, ...] | None, AllocatorCounters | None] = (None, None)   # replaced whole (threads)

    def reset(self) -> None:
        """Forget the device (after fork: the child has no CUDA context of its own yet)."""
        self._binding = None
        self._public = False
        self._device = 0
        self._torch = None
        self.device = "cpu"
        self.kind = None
        self._last = (None, None)

    def read(self) -> AllocatorCounters | None:
        binding = self._binding
        if binding is None:
            binding = self._bind()
            if binding is None:
                return None
        try:
            stats = binding(self._device)
        except RuntimeError:
            # "Invalid device argument": the allocator of this device is not set up (yet).
            return None
        if self._public:
            return AllocatorCounters.from_memory_stats(stats)
        # AllocatorCounters.from_nested, written out: a Python call less per hooked call.
        values = (stats["reserved_bytes"]["all"]["current"], stats["allocated_bytes"]["all"]["current"],
                  stats["num_device_alloc"], stats["num_device_free"], stats["num_alloc_retries"], stats["num_ooms"])
        # Between most consecutive calls nothing changed: the last object is handed back (building the named
        # tuple costs more than comparing), which also lets the recorder and the line format skip their work.
        last = self._last
        if last[0] != values:
            last = self._last = (values, _new_counters(AllocatorCounters, values))
        return last[1]

    @property
    def bound_device(self) -> int | None:
        """The CUDA device index this reader is bound to (by a read in a hooked call's or an engine signal's
        thread, whose current device is the rank's), None before: another thread must not bind it."""
        return self._device if self._binding is not None else None

    def _bind(self) -> Callable[[int], Any] | None:
        torch = self._torch or sys.modules.get("torch")
        if torch is None or not hasattr(torch, "cuda"):
            return None  # not imported (or still importing): never import it ourselves
        self._torch = torch
        # Asking for the current device before CUDA is initialized would initialize it.
        if not torch.cuda.is_initialized():
            return None
        binding: Callable[[int], Any] | None = getattr(torch._C, "_cuda_memoryStats", None)
        kind = NESTED_BINDING
        if binding is None:
            binding = torch.cuda.memory_stats
            kind = PUBLIC_MEMORY_STATS
            log.warning("memtel: torch %s has no %s: reading the allocator through %s instead (same counters, "
                        "about 10x slower per hooked call; %s{reader=%r})", getattr(torch, "__version__", "?"),
                        NESTED_BINDING, PUBLIC_MEMORY_STATS, catalogue.HOOK_ALLOCATOR_READER_INFO.series, kind)
        self._device = torch.cuda.current_device()
        self.device = f"cuda:{self._device}"
        self._public = kind == PUBLIC_MEMORY_STATS
        self.kind = kind
        self._binding = binding
        return binding

    def snapshot(self) -> tuple[Any, int | None] | None:
        """(the segments of `torch.cuda.memory_snapshot()`, this reader's device index), or None before a hooked
        call bound the device (a new thread's current device is not the serving thread's). torch takes each
        device allocator's lock while it copies the segments: the copy is the state between two allocator calls."""
        torch = self._torch
        if self._binding is None or torch is None:
            return None
        return cuda_memory_snapshot(torch), self._device


def cuda_memory_snapshot(torch: Any) -> Any:
    """`torch.cuda.memory_snapshot()`, without the allocation history where this torch can leave it out."""
    snapshot = torch.cuda.memory_snapshot
    if _takes_include_traces(snapshot):
        return snapshot(include_traces=False)
    return snapshot()


@functools.lru_cache(maxsize=4)
def _takes_include_traces(function: Callable[..., Any]) -> bool:
    try:
        return "include_traces" in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


SnapshotSource = Callable[[], Any]


class SourceReader:
    """Adapts an allocator source `fn() -> AllocatorCounters | dict | None` (the lab's simulator), and its
    `snapshot() -> segments | None` when it has one."""

    kind = ALLOCATOR_SOURCE

    def __init__(self, source: Callable[[], AllocatorCounters | Mapping[str, int] | None], device: str,
                 snapshot: SnapshotSource | None = None) -> None:
        self.source = source
        self.device = device
        self.snapshot_source = snapshot

    def reset(self) -> None:
        pass

    def snapshot(self) -> tuple[Any, int | None] | None:
        """(the source's segments in `torch.cuda.memory_snapshot()`'s format, None), or None without a snapshot
        callable or when it returns None."""
        if self.snapshot_source is None:
            return None
        segments = self.snapshot_source()
        return None if segments is None else (segments, None)

    def read(self) -> AllocatorCounters | None:
        values = self.source()
        if values is None or isinstance(values, AllocatorCounters):
            return values
        # Every field is required: a source that lost one is an error (counted), not a fake 0.
        return _new_counters(AllocatorCounters, tuple(int(values[name]) for name in FIELDS))


AllocatorReader = CudaAllocatorReader | SourceReader

_lock = threading.Lock()
_reader: AllocatorReader = CudaAllocatorReader()


def set_allocator_source(source: Callable[[], AllocatorCounters | Mapping[str, int] | None] | None, *,
                         device: str = "sim", snapshot: SnapshotSource | None = None) -> None:
    """Make the hook read `source()` after each call instead of the CUDA allocator.

    `source()` returns `AllocatorCounters`, a dict with the keys in FIELDS, or None when there is nothing
    to read. `device` is what the per-call records name as their device. `snapshot()`, if given, returns
    the allocator's segments in `torch.cuda.memory_snapshot()`'s format (the simulator's `snapshot()`) for
    the live forecast; it is called from the forecast's thread, so it must return the state between two
    allocator calls (take the lock the allocator's users take). `None` restores the default (the CUDA
    caching allocator).
    """
    global _reader
    if source is not None and not callable(source):
        raise ConfigError(f"allocator source must be a callable returning AllocatorCounters or a dict with keys "
                          f"{', '.join(FIELDS)}, got {source!r}")
    if snapshot is not None and (source is None or not callable(snapshot)):
        raise ConfigError(f"allocator snapshot must be a callable returning memory_snapshot() segments, given with "
                          f"a source, got {snapshot!r}")
    with _lock:
        _reader = CudaAllocatorReader() if source is None else SourceReader(source, device, snapshot)


def current_reader() -> AllocatorReader:
    return _reader


__all__ = ["ALLOCATOR_SOURCE", "NESTED_BINDING", "PUBLIC_MEMORY_STATS", "AllocatorReader", "CudaAllocatorReader",
           "SnapshotSource", "SourceReader", "cuda_memory_snapshot", "current_reader", "set_allocator_source"]
