"""A simulator that records its history as `torch.cuda.memory._record_memory_history()` would.

`RecordingSim` wraps `CachingAllocatorSim` and logs, in the order the real allocator records them,
`segment_alloc` / `segment_map` (and the frees of its garbage collection) then `alloc` for a malloc,
`free_requested` + `free_completed` for a free, the device frees of `empty_cache()` (which records
no event of its own), and `snapshot` when asked. `dump()` gives the dict `_snapshot()` returns (the
dump's own `snapshot` event is not in it: torch copies the history before it logs that event, as the
H200 captures show):
`segments`, `device_traces` and `allocator_settings`. Tests and benchmarks use it to make traces of
any length on a machine without a GPU; the real format comes from the H200 captures.
"""

from __future__ import annotations

from typing import Any

from .config import SIZE_MAX, parse_alloc_conf
from .simulator import CachingAllocatorSim


class RecordingSim:
    """malloc / free / empty_cache / snapshot on a simulator, each logged as trace entries."""

    def __init__(self, config: str = "", *, capacity_bytes: int | None = None, stream: int = 0) -> None:
        self.config = config
        self.sim = CachingAllocatorSim(config, capacity_bytes=capacity_bytes)
        self._calls: list[tuple[str, int, int]] = []
        self.sim.device_calls = self._calls
        self.stream = stream
        self.entries: list[dict[str, Any]] = []
        self._sizes: dict[int, int] = {}

    def _flush_calls(self) -> None:
        for action, addr, size in self._calls:
            self.entries.append({"action": action, "addr": addr, "size": size, "stream": self.stream})
        self._calls.clear()

    def malloc(self, nbytes: int) -> int:
        handle = self.sim.malloc(nbytes)
        self._flush_calls()
        block = self.sim._live[handle]
        if block is not None:
            self._sizes[handle] = nbytes
            self.entries.append({"action": "alloc", "addr": block.addr, "size": nbytes, "stream": self.stream})
        return handle

    def free(self, handle: int) -> None:
        block = self.sim._live[handle]
        if block is not None:
            size = self._sizes.pop(handle)
            self.entries.append({"action": "free_requested", "addr": block.addr, "size": size, "stream": self.stream})
            self.entries.append({"action": "free_completed", "addr": block.addr, "size": size, "stream": self.stream})
        self.sim.free(handle)
        self._flush_calls()

    def empty_cache(self) -> None:
        self.sim.empty_cache()
        self._flush_calls()

    def snapshot(self) -> list[int]:
        """Mark a checkpoint (a `snapshot` entry); returns the counters now."""
        total_active = self.sim.allocated_bytes
        self.entries.append({"action": "snapshot", "addr": 0, "size": total_active, "stream": 0})
        s = self.sim
        return [s.reserved_bytes, s.allocated_bytes, s.num_device_alloc, s.num_device_free]

    def counters(self) -> list[int]:
        s = self.sim
        return [s.reserved_bytes, s.allocated_bytes, s.num_device_alloc, s.num_device_free]

    def dump(self) -> dict[str, Any]:
        """What `torch.cuda.memory._snapshot()` returns at this point."""
        cfg = parse_alloc_conf(self.config)
        settings = {
            "PYTORCH_CUDA_ALLOC_CONF": self.config,
            "max_split_size": -1 if cfg.max_split_size == SIZE_MAX else cfg.max_split_size,
            "garbage_collection_threshold": cfg.garbage_collection_threshold,
            "expandable_segments": cfg.expandable_segments,
            "roundup_power2_divisions": {str(1 << i): n for i, n in enumerate(cfg.roundup_power2_divisions)},
        }
        return {"segments": self.sim.snapshot(), "device_traces": [list(self.entries)], "allocator_settings": settings}


__all__ = ["RecordingSim"]
