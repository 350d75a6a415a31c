"""The caching allocator's counters: one type, one CUDA reader, for the hook, the lab and the simulator.

`AllocatorCounters` is a named tuple so the hook's hot path keeps a tuple's cost while every other user
reads fields by name. Its fields are the allocator statistics memtel follows, named as PyTorch names
them (`torch.cuda.memory_stats()`: `reserved_bytes.all.current`, ..., `num_ooms`).

torch is never imported here: a process that has not imported torch has no allocator to read.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

FIELDS = ("reserved_bytes", "allocated_bytes", "num_device_alloc", "num_device_free",
          "num_alloc_retries", "num_ooms")


class AllocatorCounters(NamedTuple):
    """The allocator's counters at one moment (bytes and event counts since the process started)."""

    reserved_bytes: int
    allocated_bytes: int
    num_device_alloc: int
    num_device_free: int
    num_alloc_retries: int = 0
    num_ooms: int = 0

    @classmethod
    def from_nested(cls, stats: Mapping[str, Any]) -> AllocatorCounters:
        """From the nested dict of `torch._C._cuda_memoryStats(device)` (what `memory_stats()` flattens)."""
        return cls(stats["reserved_bytes"]["all"]["current"], stats["allocated_bytes"]["all"]["current"],
                   stats["num_device_alloc"], stats["num_device_free"], stats["num_alloc_retries"],
                   stats["num_ooms"])

    @classmethod
    def from_memory_stats(cls, stats: Mapping[str, Any]) -> AllocatorCounters:
        """From the flat dict of `torch.cuda.memory_stats()`."""
        return cls(int(stats.get("reserved_bytes.all.current", 0)), int(stats.get("allocated_bytes.all.current", 0)),
                   int(stats.get("num_device_alloc", 0)), int(stats.get("num_device_free", 0)),
                   int(stats.get("num_alloc_retries", 0)), int(stats.get("num_ooms", 0)))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> AllocatorCounters:
        """From a dict keyed by FIELDS (an allocator source, a JSON record); missing event counts are 0."""
        return cls(*(int(values.get(name, 0)) for name in FIELDS))

    def minus(self, base: AllocatorCounters) -> AllocatorCounters:
        """These counters relative to `base` (an op's row relative to the start of a case)."""
        return AllocatorCounters(*(a - b for a, b in zip(self, base, strict=True)))

    def row(self) -> list[int]:
        """`[reserved, allocated, num_device_alloc, num_device_free]`: one row of the allocator-truth format."""
        return [self.reserved_bytes, self.allocated_bytes, self.num_device_alloc, self.num_device_free]

    def as_dict(self) -> dict[str, int]:
        return dict(zip(FIELDS, self, strict=True))


def read_cuda_counters(device: int | None = None) -> AllocatorCounters | None:
    """The CUDA caching allocator's counters of `device` (the current one by default), off the hot path.

    None where torch is not imported, CUDA is not initialised, or the device has no allocator yet.
    Reads the nested binding when torch has it, else the public `torch.cuda.memory_stats()`.
    """
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "cuda") or not torch.cuda.is_initialized():
        return None
    index = torch.cuda.current_device() if device is None else device
    binding = getattr(torch._C, "_cuda_memoryStats", None)
    try:
        if binding is not None:
            return AllocatorCounters.from_nested(binding(index))
        return AllocatorCounters.from_memory_stats(torch.cuda.memory_stats(index))
    except RuntimeError:
        return None


__all__ = ["FIELDS", "AllocatorCounters", "read_cuda_counters"]
