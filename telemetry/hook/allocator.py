"""Allocator statistics for the hook: one read per hooked call.

The default source is the CUDA caching allocator read through torch's nested statistics binding,
`torch._C._cuda_memoryStats(device)` (what `torch.cuda.memory_stats` calls before it flattens and
sorts all keys): one C++ call returns every counter, about 10 us on an H200 against 80-140 us for
`memory_stats()` / `memory_reserved()`. The lab server replaces the source with its simulator
through `set_allocator_source` (docs/architecture.md, "Allocator source").

torch is never imported here: a process that has not imported torch has no allocator to read.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

FIELDS = ("reserved_bytes", "allocated_bytes", "num_device_alloc", "num_device_free",
          "num_alloc_retries", "num_ooms")

AllocatorStats = tuple  # the FIELDS values, in that order


class CudaAllocatorReader:
    """Reads the CUDA caching allocator of the current device; None where there is none (yet)."""

    def __init__(self) -> None:
        self._binding: Callable | None = None
        self._device: int | None = None
        self._torch = None
        self.device: str | None = None  # "cuda:N" once bound (the record's `device`)

    def reset(self) -> None:
        """Forget the device (after fork: the child has no CUDA context of its own yet)."""
        self._binding = None
        self._device = None
        self._torch = None
        self.device = None

    def read(self) -> AllocatorStats | None:
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
        return (stats["reserved_bytes"]["all"]["current"], stats["allocated_bytes"]["all"]["current"],
                stats["num_device_alloc"], stats["num_device_free"], stats["num_alloc_retries"],
                stats["num_ooms"])


    def _bind(self) -> Callable | None:
        torch = self._torch or sys.modules.get("torch")
        if torch is None or not hasattr(torch, "cuda"):
            return None  # not imported (or still importing): never import it ourselves
        self._torch = torch
        # Asking for the current device before CUDA is initialized would initialize it.
        if not torch.cuda.is_initialized():
            return None
        binding = getattr(torch._C, "_cuda_memoryStats", None)
        if binding is None:
            return None
        self._device = torch.cuda.current_device()
        self.device = f"cuda:{self._device}"
        self._binding = binding
        return binding


class DictSourceReader:
    """Adapts a `fn() -> dict | None` allocator source (the lab's simulator) to the reader protocol."""

    def __init__(self, source: Callable[[], dict | None], device: str) -> None:
        self.source = source
        self.device = device

    def reset(self) -> None:
        pass

    def read(self) -> AllocatorStats | None:
        stats = self.source()
        if stats is None:
            return None
        return tuple(int(stats[name]) for name in FIELDS)



_lock = threading.Lock()
_reader: CudaAllocatorReader | DictSourceReader = CudaAllocatorReader()


def set_allocator_source(source: Callable[[], dict | None] | None, *, device: str = "sim") -> None:
    """Make the hook read `source()` after each call instead of the CUDA allocator.

    `source()` returns a dict with the keys in FIELDS, or None when there is nothing to read.
    `device` is what the per-call records name as their device. `None` restores the default
    (the CUDA caching allocator).
    """
    global _reader
    if source is not None and not callable(source):
        raise ValueError(f"allocator source must be a callable returning a dict with keys {FIELDS}, "
                         f"got {source!r}")
    with _lock:
        _reader = CudaAllocatorReader() if source is None else DictSourceReader(source, device)


def current_reader() -> CudaAllocatorReader | DictSourceReader:
    return _reader


def read_allocator() -> dict | None:
    """The current source's values as a dict (off the hot path: baselines, tests)."""
    values = _reader.read()
    return None if values is None else dict(zip(FIELDS, values))
