"""Where a prefill's launches allocate: one protocol, a simulator and a CUDA implementation.

`LaunchBackend` is what the launch loop (`telemetry.model.indexer.prefill.run_prefill`) needs: make a logits
launch through the hook target `telemetry.model.indexer.launch:indexer_logits_launch`, allocate and release
other tensors, and read the allocator's counters as `AllocatorCounters`. `memtel replay`, the demo's
prediction, the truth capture and the lab server's ranks all use these two implementations.

torch is imported only when a `CudaBackend` is made.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol, cast

from telemetry.allocator_counters import AllocatorCounters, read_cuda_counters
from telemetry.errors import ConfigError, RunError
from telemetry.model.indexer import launch as indexer

SegmentHook = Callable[[object, int], None]


class LaunchBackend(Protocol):
    """An allocator the launch loop allocates on."""

    name: str  # "sim" or "cuda"

    def launch(self, rows: int, width: int, kv_len: int) -> object:
        """One logits launch ``[rows, width]`` float32 through `indexer_logits_launch`; returns its allocation."""
        ...

    def alloc(self, nbytes: int) -> object:
        """Any other allocation of `nbytes` (top-k outputs, transients); returns it."""
        ...

    def release(self, allocation: object) -> None:
        """Free what `launch` or `alloc` returned (the caller holds no other reference)."""
        ...

    def counters(self) -> AllocatorCounters:
        """The allocator's counters now (since the process, or the simulator, started)."""
        ...

    def finish(self) -> None:
        """End of a prefill: wait until the device has done the work (nothing to wait for on a simulator)."""
        ...

    def close(self) -> None:
        ...

    def describe(self) -> dict[str, Any]:
        """What this backend is, for a server's /version and a report (`allocator` at least)."""
        ...


class _LockedPool:
    """A simulator whose ops take `lock`: what the logits launch allocates on, so the lock is held for the
    simulated cudaMalloc only, not for the rest of the (hooked) launch, as CUDA's allocator lock is."""

    def __init__(self, sim: Any, lock: threading.Lock) -> None:
        self.sim = sim
        self.lock = lock

    def malloc(self, nbytes: int) -> int:
        with self.lock:
            return int(self.sim.malloc(nbytes))

    def free(self, handle: int) -> None:
        with self.lock:
            self.sim.free(handle)

    def stats(self) -> dict[str, int]:
        return dict(self.sim.stats())


class SimBackend:
    """The caching-allocator simulator of one process; a private logits pool is a second simulator.

    alloc_conf: `PYTORCH_CUDA_ALLOC_CONF` settings of the simulated allocator.
    mempool: logits in their own pool (`torch.cuda.MemPool`), the other allocations in the main one.
    capacity_bytes: the simulated device's memory (None: unlimited).
    on_segment_map / on_segment_unmap: called with (segment key, bytes) whenever device memory is mapped
        or released (the lab server backs segments with host pages); keys are unique across both pools.

    One lock orders the simulated ops and `snapshot()`, so another thread (the hook's live forecast) sees the
    state between two ops, as CUDA's snapshot does under the allocator's lock; it is held for the op alone.
    """

    name = "sim"
    PRIVATE_POOL = (1, 0)   # the `segment_pool_id` a private logits pool's segments carry in `snapshot()`

    def __init__(self, alloc_conf: str = "", *, mempool: bool = False, capacity_bytes: int | None = None,
                 on_segment_map: SegmentHook | None = None, on_segment_unmap: SegmentHook | None = None) -> None:
        from telemetry.model.allocsim import CachingAllocatorSim, DriverAddressSpace

        driver = DriverAddressSpace()  # one process: both pools' segments come from one driver

        def simulator(pool: str) -> CachingAllocatorSim:
            hooks: dict[str, Any] = {}
            if on_segment_map is not None:
                hooks["on_segment_map"] = lambda segment, nbytes: on_segment_map((pool, segment), nbytes)
            if on_segment_unmap is not None:
                hooks["on_segment_unmap"] = lambda segment, nbytes: on_segment_unmap((pool, segment), nbytes)
            return CachingAllocatorSim(alloc_conf, capacity_bytes=capacity_bytes, address_space=driver, **hooks)

        self.main = simulator("main")
        self.logits_pool = simulator("logits") if mempool else self.main
        self.lock = threading.Lock()
        self._locked_logits = _LockedPool(self.logits_pool, self.lock)

    def launch(self, rows: int, width: int, kv_len: int) -> object:
        # Through the module attribute, at call time: an installed hook sees every launch.
        return (self.logits_pool, indexer.indexer_logits_launch(self._locked_logits, rows, width, kv_len))

    def alloc(self, nbytes: int) -> object:
        with self.lock:
            return (self.main, self.main.malloc(nbytes))

    def release(self, allocation: object) -> None:
        pool, handle = cast("tuple[Any, int]", allocation)
        with self.lock:
            pool.free(handle)

    def snapshot(self) -> list[dict[str, Any]]:
        """The segments in `torch.cuda.memory_snapshot()`'s format, between two ops; a private logits pool's
        carry `PRIVATE_POOL` as their pool id (a forecast keeps them as reserved memory, as a MemPool's)."""
        with self.lock:
            segments = self.main.snapshot()
            if self.logits_pool is not self.main:
                for segment in self.logits_pool.snapshot():
                    segment["segment_pool_id"] = self.PRIVATE_POOL
                    segments.append(segment)
        return sorted(segments, key=lambda segment: segment["address"])

    def counters(self) -> AllocatorCounters:
        main = AllocatorCounters.from_mapping(self.main.stats())
        if self.logits_pool is self.main:
            return main
        logits = AllocatorCounters.from_mapping(self.logits_pool.stats())
        return AllocatorCounters(*(a + b for a, b in zip(main, logits, strict=True)))

    def finish(self) -> None:
        """Nothing is in flight on a simulator."""

    def close(self) -> None:
        """Nothing to release: the simulator is plain Python objects."""

    def describe(self) -> dict[str, Any]:
        return {"allocator": "sim", "mempool": self.logits_pool is not self.main}


class CudaBackend:
    """Real allocations through PyTorch's CUDA caching allocator on one device.

    device: a torch device ("cuda", "cuda:1", an index); mempool: logits in a private `torch.cuda.MemPool`.
    Starts with `empty_cache()`, so a process that allocated nothing yet starts from zero.
    """

    name = "cuda"

    def __init__(self, device: str | int = "cuda", *, mempool: bool = False) -> None:
        try:
            import torch
        except ImportError:
            raise RunError("the cuda allocator needs torch with CUDA in this Python; use the simulator (sim)") from None
        if not torch.cuda.is_available():
            raise RunError("the cuda allocator needs a CUDA GPU and a CUDA build of torch; use the simulator (sim)")
        try:
            chosen = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        except RuntimeError as exc:
            raise ConfigError(f"not a CUDA device: {device!r} ({exc})") from None
        if chosen.type != "cuda":
            raise ConfigError(f"not a CUDA device: {device!r} (expected cuda, cuda:N or an index)")
        self.torch = torch
        torch.cuda.init()
        self.index = chosen.index if chosen.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self.index)
        torch.cuda.set_device(self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.pool = torch.cuda.MemPool() if mempool else None

    def launch(self, rows: int, width: int, kv_len: int) -> object:
        if self.pool is None:
            return indexer.indexer_logits_launch(self.device, rows, width, kv_len)
        with self.torch.cuda.use_mem_pool(self.pool):
            return indexer.indexer_logits_launch(self.device, rows, width, kv_len)

    def alloc(self, nbytes: int) -> object:
        return self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.device)

    def release(self, allocation: object) -> None:
        del allocation  # the caller held the only other reference: dropping it frees the block

    def counters(self) -> AllocatorCounters:
        counters = read_cuda_counters(self.index)
        if counters is None:
            raise RunError(f"cannot read the CUDA caching allocator's counters of {self.device}")
        return counters

    def finish(self) -> None:
        """Wait for the GPU, so a prefill's time is the GPU's."""
        self.torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Nothing to release: the process's exit frees the device memory."""

    def describe(self) -> dict[str, Any]:
        properties = self.torch.cuda.get_device_properties(self.device)
        # An integrated GPU (Jetson, GB10-class) takes its memory from the host: MemAvailable moves.
        return {"allocator": "cuda", "device": str(self.device), "device_name": properties.name,
                "device_total_bytes": int(properties.total_memory), "torch": self.torch.__version__,
                "integrated": bool(getattr(properties, "is_integrated", False)), "mempool": self.pool is not None}


def cuda_available() -> bool:
    """Whether torch is importable here and sees a GPU (torch is imported only to ask)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


ALLOCATORS = ("sim", "cuda")


def default_allocator() -> str:
    """cuda when torch sees a GPU, else sim."""
    return "cuda" if cuda_available() else "sim"


__all__ = ["ALLOCATORS", "CudaBackend", "LaunchBackend", "SimBackend", "cuda_available", "default_allocator"]
