"""The event shadow: the allocator's state kept in the helper process from its trace events, checked as it goes.

The forecast thread takes one full native snapshot, then only the allocator's events since the last cycle
(snapshot_native/events.py). `Shadow` is seeded with that snapshot's segments of one device and replays each
event on memtel's simulator (telemetry.model.allocsim, the same one the forecast runs), checking it against what
the real allocator reported:
- `alloc` (the requested bytes, as the allocator's trace gives them): the simulator's malloc must land at the
  event's address, and make exactly the segment calls (`segment_alloc` / `segment_free` / `segment_map` /
  `segment_unmap`, address and bytes) the allocator logged before it; its cudaMalloc addresses are the logged ones;
- `free_requested`: the block stays allocated, shown `active_pending_free` until its `free_completed` frees it;
- segment frees no allocation explains (`empty_cache()`, which has no event of its own): replayed as
  `empty_cache()`, whose calls must be exactly those.
Anything else stops it with `ShadowLost(reason)`: an address or call that differs (`mismatch`), an event of a
private pool (`pool`) or of another stream (`stream`), an out-of-memory (`oom`: the simulator is not told the
device's limit), or a log that dropped events (`overflow`). Then the thread takes a full snapshot again and counts
the reason (memtel_forecast_snapshot_resyncs_total). Events of other devices do not touch this device's
allocator and are skipped. `segments()` is the shadow's state in `torch.cuda.memory_snapshot()`'s format.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from telemetry.hook.forecast.snapshot_native.events import Event
from telemetry.model.allocsim.simulator import CachingAllocatorSim, SimulatedOutOfMemoryError
from telemetry.model.allocsim.snapshot import DEFAULT_POOL, SnapshotError, read_allocator_state
from telemetry.model.allocsim.trace import (
    ACTION_NAMES,
    ALLOC,
    FREE_COMPLETED,
    FREE_REQUESTED,
    GROW,
    OOM,
    SEGMENT_ALLOC,
    SHRINK,
    SNAPSHOT,
)
from telemetry.model.allocsim.whatif import empty_cache_explains

# Why the shadow was given up and a full snapshot taken (label `reason` of memtel_forecast_snapshot_resyncs_total).
START = "start"          # the first snapshot (or the helper process started again)
MISMATCH = "mismatch"    # an allocation's address or a segment call differed from the allocator's
POOL = "pool"            # an event of a private pool (CUDA graphs, MemPool), or a torch whose events name no pool
STREAM = "stream"        # an event on another stream than the shadow's
OOM_EVENT = "oom"        # the allocator ran out of memory (the simulator is not told the device's limit)
OVERFLOW = "overflow"    # the event log dropped events between two cycles
NO_MARKER = "no_marker"  # the log does not show where the full snapshot was taken
LOST = "lost"            # events taken but not replayed (a cycle that stopped early, the helper gone)
STATE = "state"          # the snapshot holds what the shadow cannot seed from (several streams, ...)
RESYNC_REASONS = (START, MISMATCH, POOL, STREAM, OOM_EVENT, OVERFLOW, NO_MARKER, LOST, STATE)
Call = tuple[str, int, int]   # (the allocator trace's name of a device call, address, bytes)


class ShadowLost(Exception):
    """The shadow no longer follows the allocator; `reason` is one of RESYNC_REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


class _LoggedAddresses:
    """The simulator's cudaMalloc addresses: the ones the allocator logged for the call being replayed."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, int]] = []   # (address, bytes) of the logged segment_alloc calls, in order

    def alloc(self, size: int) -> int:
        if not self.pending or self.pending[0][1] != size:
            logged = f"{self.pending[0][1]:,} bytes" if self.pending else "none"
            raise ShadowLost(MISMATCH, f"the simulator made a cudaMalloc of {size:,} bytes where the allocator's "
                                       f"next one was {logged}")
        return self.pending.pop(0)[0]

    def release(self, address: int, size: int) -> None:
        pass


class Shadow:
    """One device's allocator state, seeded from a snapshot's segments, moved on by its events."""

    def __init__(self, segments: Sequence[Mapping[str, Any]], device: int, conf: str,
                 total_memory: int | None = None) -> None:
        try:
            state = read_allocator_state(list(segments), device=device, source="the shadow's snapshot")
        except SnapshotError as error:
            raise ShadowLost(STATE, str(error)) from None
        self.device = device
        self.stream: int | None = state.stream if state.segments else None
        self.private = [dict(s) for s in segments if s.get("device", 0) == device
                        and tuple(s.get("segment_pool_id", DEFAULT_POOL)) != DEFAULT_POOL]
        self._addresses = _LoggedAddresses()
        try:
            self.sim = CachingAllocatorSim(conf, address_space=self._addresses, total_memory=total_memory)
            # A block pending free is still allocated for the allocator: it is freed at its free_completed.
            handles = self.sim.seed(
                [(s.address, s.small, s.expandable, [(b.size, b.state != "inactive") for b in s.blocks])
                 for s in state.segments],
                [(s.address, s.total_size, s.allocated_bytes) for s in state.private_segments])
        except (ValueError, SnapshotError) as error:
            raise ShadowLost(STATE, f"cannot seed the simulator: {error}") from None
        self.handles: dict[int, int] = {}
        for handle in handles:
            address = self.sim.block_address(handle)
            assert address is not None
            self.handles[address] = handle
        self.pending_free = {b.address for s in state.segments for b in s.blocks if b.state == "active_pending_free"}
        self.calls: list[Call] = []
        self.sim.device_calls = self.calls
        self.logged: list[tuple[int, Call]] = []   # the allocator's device calls not yet replayed: (action, call)
        self.replayed = 0

    # ---- replay -------------------------------------------------------------------------------------------------

    def apply(self, events: Iterable[Event]) -> None:
        """Replay `events` (ShadowLost where they cannot be followed exactly; the shadow is then unusable)."""
        for event in events:
            if event.action == SNAPSHOT or event.device != self.device:
                continue
            self._check(event)
            action = event.action
            if action in GROW or action in SHRINK:
                name = GROW.get(action) or SHRINK[action]
                self.logged.append((action, (name, event.addr, event.size)))
                if action == SEGMENT_ALLOC:
                    self._addresses.pending.append((event.addr, event.size))
            elif action == ALLOC:
                self._alloc(event)
            elif action == FREE_REQUESTED:
                self._settle()
                if event.addr not in self.handles:
                    raise ShadowLost(MISMATCH, f"a free of {event.addr:#x}, which the shadow holds no block at")
                self.pending_free.add(event.addr)
            elif action == FREE_COMPLETED:
                self._settle()
                handle = self.handles.pop(event.addr, None)
                if handle is None:
                    raise ShadowLost(MISMATCH, f"a completed free of {event.addr:#x}, which the shadow holds no "
                                               "block at")
                self.pending_free.discard(event.addr)
                self.sim.free(handle)
            elif action == OOM:
                raise ShadowLost(OOM_EVENT, f"the allocator ran out of memory on a {event.size:,}-byte request")
            else:   # pragma: no cover - every action of ACTIONS is handled above
                raise ShadowLost(MISMATCH, f"an event the shadow does not model ({ACTION_NAMES[action]})")
            self.replayed += 1
        if self.logged and all(action in SHRINK for action, _ in self.logged):
            self._settle()   # an empty_cache() at the end of the log: the state now is without those segments

    def _check(self, event: Event) -> None:
        if event.action == OOM:
            return
        if event.pool != DEFAULT_POOL:
            raise ShadowLost(POOL, f"an event of memory pool {event.pool} (only the default pools are followed)")
        if self.stream is None:
            self.stream = event.stream
        elif event.stream != self.stream:
            raise ShadowLost(STREAM, f"an event on stream {event.stream:#x}; the shadow follows {self.stream:#x}")

    def _settle(self) -> None:
        """Segment frees logged before a free or at the end: an `empty_cache()`, replayed and checked."""
        if not self.logged:
            return
        if any(action in GROW for action, _ in self.logged):
            raise ShadowLost(MISMATCH, "device allocations that no allocation used")
        self._replay_calls(self.sim.empty_cache, "empty_cache()")

    def _replay_calls(self, step: Any, what: str) -> Any:
        expected = [call for _, call in self.logged]
        self.calls.clear()
        try:
            result = step()
        except SimulatedOutOfMemoryError as error:
            raise ShadowLost(MISMATCH, f"the simulator ran out of memory where the allocator did not: {error}") \
                from None
        if self.calls != expected:
            raise ShadowLost(MISMATCH, f"{what}: the simulator's device calls {_shown(self.calls)} are not the "
                                       f"allocator's {_shown(expected)}")
        self.logged.clear()
        self._addresses.pending.clear()
        return result

    def _alloc(self, event: Event) -> None:
        shrinks = [(action, name, size) for action, (name, _, size) in self.logged if action in SHRINK]
        # Frees before the allocation: its own garbage collection, or an empty_cache() that came before it
        # (told apart as the allocation history's replay does; the replay below checks either).
        if shrinks and self.logged[0][0] in SHRINK and empty_cache_explains(self.sim, shrinks):
            grows = [entry for entry in self.logged if entry[0] in GROW]
            head = [entry for entry in self.logged if entry[0] in SHRINK]
            pending = list(self._addresses.pending)
            self.logged[:] = head
            self._addresses.pending.clear()
            self._replay_calls(self.sim.empty_cache, "empty_cache()")
            self.logged[:] = grows
            self._addresses.pending[:] = pending
        handle = self._replay_calls(lambda: self.sim.malloc(event.size), f"an allocation of {event.size:,} bytes")
        address = self.sim.block_address(handle)
        if address != event.addr:
            shown = "none" if address is None else f"{address:#x}"
            raise ShadowLost(MISMATCH, f"an allocation of {event.size:,} bytes landed at {shown} in the simulator, at "
                                       f"{event.addr:#x} in the allocator")
        if address in self.handles:
            raise ShadowLost(MISMATCH, f"an allocation at {address:#x}, where the shadow holds a live block")
        self.handles[address] = handle

    # ---- the state ----------------------------------------------------------------------------------------------

    def segments(self) -> list[dict[str, Any]]:
        """The state now, as `torch.cuda.memory_snapshot()` lists this device's segments (the keys memtel reads)."""
        out = self.sim.snapshot(self.device)
        stream = self.stream or 0
        pending = self.pending_free
        for segment in out:
            segment["stream"] = stream
            if pending:
                for block in segment["blocks"]:
                    if block["address"] in pending:
                        block["state"] = "active_pending_free"
        return out + [dict(s) for s in self.private]


def after_marker(events: Sequence[Event], device: int) -> list[Event]:
    """The events after the full snapshot passed `device`'s allocator (its SNAPSHOT record); ShadowLost if none."""
    for index, event in enumerate(events):
        if event.action == SNAPSHOT and event.device == device:
            return list(events[index + 1:])
    raise ShadowLost(NO_MARKER, f"the event log shows no snapshot of device {device}'s allocator")


def _shown(calls: list[Call], limit: int = 4) -> str:
    text = ", ".join(f"{name} {address:#x} {size:,}" for name, address, size in calls[:limit])
    return f"[{text}{', ...' if len(calls) > limit else ''}]"


__all__ = ["RESYNC_REASONS", "START", "Shadow", "ShadowLost", "after_marker"]
