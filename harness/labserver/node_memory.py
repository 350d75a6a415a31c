"""The lab node's emulated unified memory: `memtel lab serve --capacity-gb X` (sim allocator).

One node of X GiB shared by every rank, as a DGX Spark's 128 GB are shared by its processes. Each rank's
simulated allocator may reserve what the node has left: before every simulated launch the rank takes the
node's lock, sets its simulator's capacity to its own reserved bytes plus the node's free bytes, runs the
launch and publishes its reserved bytes. A launch beyond the node fails as on the device: the simulator frees
its cache and retries (`CachingAllocatorSim`), then raises; the rank logs a line like the driver's
(`NVRM: ... Out of memory [NV_ERR_NO_MEMORY]`) and reports out of memory, and the engine dies as vLLM's
does (engine.py, server.py).

The hook's fit budget in the lab is this node's free memory (`set_forecast_budget(node.free_bytes, reserve_mib=0)`:
no reserve is kept for other processes), shared by the ranks (LOCAL_WORLD_SIZE). Another tenant (tenant.py: a
second engine starting, a job) takes its bytes out of the node too, so both the launches and that budget see it.
"""

from __future__ import annotations

import logging
from typing import Any

from telemetry.model.allocsim.simulator import SimulatedOutOfMemoryError

log = logging.getLogger("memtel.lab.worker")

GIB = 1 << 30
MIB = 1 << 20
NV_ERR_NO_MEMORY = 0x51   # the driver's NV_ERR_NO_MEMORY status (nvstatuscodes.h)


class LabOutOfMemoryError(MemoryError):
    """A rank's launch did not fit in the lab node's memory (the lab's torch.OutOfMemoryError)."""


class NodeMemory:
    """X bytes shared by `ranks` rank processes and another tenant: a lock and each one's bytes in shared memory.

    Made by the engine with its multiprocessing context and handed to each rank at its start (spawn)."""

    def __init__(self, capacity_bytes: int, ranks: int, context: Any) -> None:
        self.capacity_bytes = capacity_bytes
        self.ranks = ranks
        self.lock = context.Lock()
        # Guarded by self.lock: each rank's reserved bytes, then the other tenant's (slot `ranks`).
        self.reserved = context.Array("q", ranks + 1, lock=False)

    def used_bytes(self) -> int:
        with self.lock:
            return sum(self.reserved)

    def free_bytes(self) -> int:
        """What the node's ranks may still reserve together (the hook's budget reads it)."""
        return max(self.capacity_bytes - self.used_bytes(), 0)

    def tenant_bytes(self) -> int:
        with self.lock:
            return int(self.reserved[self.ranks])

    def set_tenant(self, nbytes: int) -> int:
        """Another process holds `nbytes` from now on (0: it gave its memory back), or what the ranks leave free
        if that is less: it cannot take what they hold. Returns what it holds."""
        with self.lock:
            ranks_hold = sum(self.reserved[:self.ranks])
            held = max(min(nbytes, self.capacity_bytes - ranks_hold), 0)
            self.reserved[self.ranks] = held
            return held


class NodeLimitedBackend:
    """A rank's `SimBackend` whose launches and allocations fit in the node's memory (see the module)."""

    def __init__(self, backend: Any, node: NodeMemory, rank: int) -> None:
        self.backend = backend
        self.node = node
        self.rank = rank
        self._sims = [backend.main] if backend.logits_pool is backend.main else [backend.main, backend.logits_pool]

    def __getattr__(self, name: str) -> Any:   # counters, snapshot, release, finish, close, describe, name
        return getattr(self.backend, name)

    def launch(self, rows: int, width: int, kv_len: int) -> object:
        return self._within_node(self.backend.launch, rows, width, kv_len)

    def alloc(self, nbytes: int) -> object:
        return self._within_node(self.backend.alloc, nbytes)

    def _within_node(self, call: Any, *args: int) -> object:
        node = self.node
        with node.lock:
            own = sum(sim.reserved_bytes for sim in self._sims)
            others = sum(node.reserved) - node.reserved[self.rank]
            room = node.capacity_bytes - others - own
            for sim in self._sims:
                sim.capacity_bytes = sim.reserved_bytes + max(room, 0)
            try:
                return call(*args)
            except SimulatedOutOfMemoryError as error:
                in_use = others + sum(sim.reserved_bytes for sim in self._sims)
                tenant = node.reserved[node.ranks]
                log.error("NVRM: memtel lab rank %d: Out of memory [NV_ERR_NO_MEMORY] (0x%08x) mapping memory for "
                          "the caching allocator: %.2f of %.2f GiB of the node's unified memory in use%s (%s)",
                          self.rank, NV_ERR_NO_MEMORY, in_use / GIB, node.capacity_bytes / GIB,
                          f", {tenant / GIB:.2f} GiB of it by another tenant" if tenant else "", error)
                raise LabOutOfMemoryError(
                    f"CUDA out of memory on lab rank {self.rank}: the node's {node.capacity_bytes / GIB:g} GiB of "
                    f"unified memory are used up ({in_use / MIB:,.0f} MiB in use; {error})") from None
            finally:
                node.reserved[self.rank] = sum(sim.reserved_bytes for sim in self._sims)


__all__ = ["LabOutOfMemoryError", "NodeLimitedBackend", "NodeMemory"]
