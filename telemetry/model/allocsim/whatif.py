"""What-if replay: a recorded allocator history replayed under other allocator settings.

The trace's `alloc` and `free_completed` events are replayed on the simulator; its segment events
(the real allocator's cudaMalloc / cudaFree / map / unmap) are the check, not input: under the
recorded settings the replay must make the same device calls with the same sizes at the same
points. `empty_cache()` leaves no event of its own; it shows as device frees that no allocation
caused, so frees of segments before a `free`, a `snapshot` or the end of the trace, or before an
allocation that needs no new memory, are replayed as `empty_cache()` there. Device frees that
lead into an allocation's own new segment are that allocation's garbage collection when the
recorded settings collect garbage (a memory fraction with a threshold), unless they are exactly
what `empty_cache()` would release at that point (the plan runs the recorded settings' simulator
as it goes to see that) or unmap pages (garbage collection never does): then `empty_cache()`;
without garbage collection they are `empty_cache()` too (the other cause, a full device, needs
`--capacity-gb` to be modelled).

Garbage collection frees blocks by age, and a block's age depends on which of several equal-size
free blocks each request took: the lowest address. The replay under the recorded settings gives
its segments the trace's own cudaMalloc addresses (TraceAddresses); the driver model
(driver_va.py) stands in for the other settings and once the replay has left the trace.

A history is incomplete when it does not begin with an empty allocator: the ring of `max_entries`
dropped its start, or recording began after memory was allocated. It shows as frees of blocks or
segments the history never allocated, and as a replay that ends elsewhere than the process's own
snapshot at the dump. Each replay then starts from an empty allocator without the missing blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import parse_alloc_conf
from .driver_va import DriverAddressSpace
from .simulator import CachingAllocatorSim, SimulatedOutOfMemoryError
from .trace import (
    ALLOC,
    FREE_COMPLETED,
    FREE_REQUESTED,
    GROW,
    OOM,
    SEGMENT_ALLOC,
    SEGMENT_FREE,
    SEGMENT_UNMAP,
    SHRINK,
    SNAPSHOT,
    MemoryTrace,
)

OP_ALLOC, OP_FREE, OP_EMPTY_CACHE, OP_CHECKPOINT, OP_OOM = range(5)
INCOMPLETE_MEANING = (
    "the history does not start from an empty allocator (the ring of max_entries dropped its start, or "
    "recording began after memory was allocated): blocks and segments from before it are missing from every "
    "replay, so the figures are those of the recorded part alone, relative to its start, and reuse of the "
    "missing blocks is not modelled; record from the start with a larger max_entries for exact answers")
SegmentEvent = tuple[int, str, int]  # (op index, action, bytes)


@dataclass
class ReplayPlan:
    """The trace as ops for the simulator, and the device calls the real allocator made at each op."""

    ops: list[tuple[int, int, int]] = field(default_factory=list)
    expected: list[SegmentEvent] = field(default_factory=list)
    allocs: int = 0
    frees: int = 0
    checkpoints: int = 0
    empty_caches: int = 0
    ooms: int = 0
    unknown_frees: int = 0
    unknown_segment_frees: int = 0
    reused_live_addresses: int = 0
    frees_from_requested: bool = False
    segment_addresses: list[tuple[int, int]] = field(default_factory=list)  # (address, bytes) of each cudaMalloc


class TraceAddresses:
    """The trace's own cudaMalloc addresses, in order, while the replay asks for the sizes the trace did (and
    none overlaps a segment the replay still holds).

    The caching allocator breaks ties between equal-size free blocks by device address, and with garbage
    collection which block a request takes decides every block's age. The driver model (driver_va.py) gets
    most addresses right, not all; a replay takes the real ones instead, under the recorded settings and under
    another setting as long as it makes the trace's cudaMallocs (the same driver gives the same calls the same
    addresses: a what-if under a GC threshold on an H200 took the other of two 12 MiB blocks with the model's).
    From the first request of another size on (the replay has left the trace), the driver model answers, started
    from the trace's segments the replay holds then.
    """

    def __init__(self, recorded: list[tuple[int, int]]) -> None:
        self._recorded = recorded
        self._next = 0
        self._given: dict[int, int] = {}   # address -> size of the trace's segments live here
        self._model: DriverAddressSpace | None = None

    def alloc(self, size: int) -> int:
        if self._model is None and self._next < len(self._recorded) and self._recorded[self._next][1] == size:
            address = self._recorded[self._next][0]
            # another setting may still hold a segment where the trace's had been freed: then it has left the trace
            if not any(a < address + size and address < a + n for a, n in self._given.items()):
                self._next += 1
                self._given[address] = size
                return address
        if self._model is None:   # left the trace: the model goes on from the segments the trace's addresses hold
            self._model = DriverAddressSpace.from_segments(sorted(self._given.items()))
            self._given = {}
        return self._model.alloc(size)

    def release(self, address: int, size: int) -> None:
        if address in self._given:
            del self._given[address]
        elif self._model is not None:
            self._model.release(address, size)


def empty_cache_explains(sim: CachingAllocatorSim, shrinks: list[tuple[int, str, int]]) -> bool:
    """Whether device frees before an allocation's new segment are an `empty_cache()` rather than its GC.

    Its garbage collection when the pass the simulator would make now frees those sizes in that order (any
    frees after them: the retry that releases every cached block under the memory fraction); else an
    `empty_cache()` when that is exactly what one would release now, or when pages are unmapped (garbage
    collection never unmaps); else its garbage collection still (the check then shows the difference).
    """
    sizes = [size for _, _, size in shrinks]
    collected = sim.garbage_collection_frees()
    if collected and sizes[:len(collected)] == collected:
        return False
    if any(code == SEGMENT_UNMAP for code, _, _ in shrinks):
        return True
    would = sim.empty_cache_frees()
    return would is not None and would == sizes


def plan_trace(trace: MemoryTrace, gc_active: bool, config: str | None = None,
               capacity_bytes: int | None = None) -> ReplayPlan:
    """Turn a trace into simulator ops, inferring `empty_cache()` calls (see the module's docstring).

    config: the recorded settings; with garbage collection active, the ops run on a simulator as they are
    planned, which tells an `empty_cache()` from an allocation's garbage collection.
    """
    plan = ReplayPlan()
    ops, expected = plan.ops, plan.expected
    look = (Replayer(config, capacity_bytes, TraceAddresses(plan.segment_addresses))
            if gc_active and config is not None else None)
    free_code = FREE_COMPLETED
    if not any(code == FREE_COMPLETED for code, _, _ in trace.events):
        free_code = FREE_REQUESTED  # recorded with skip_actions=["free_completed"]
        plan.frees_from_requested = True
    pending: list[tuple[int, str, int]] = []  # (code, action, bytes) of device calls waiting for their op
    live: set[int] = set()
    segments: set[int] = set()

    def append(op: tuple[int, int, int]) -> None:
        ops.append(op)
        if look is not None:
            look.step(*op)

    def flush() -> None:
        if pending:
            append((OP_EMPTY_CACHE, 0, 0))
            plan.empty_caches += 1
            index = len(ops) - 1
            expected.extend((index, action, size) for _, action, size in pending)
            pending.clear()

    skipped = FREE_REQUESTED if free_code == FREE_COMPLETED else FREE_COMPLETED
    for code, addr, size in trace.events:
        if code == ALLOC:
            if pending:
                grows = [p for p in pending if p[0] in GROW]
                shrinks = [p for p in pending if p[0] not in GROW]
                collects = gc_active and grows and not (look is not None and empty_cache_explains(look.sim, shrinks))
                if shrinks and not collects:
                    pending[:] = [p for p in pending if p[0] not in GROW]
                    flush()
                    pending[:] = grows
                expected.extend((len(ops), action, nbytes) for _, action, nbytes in pending)
                pending.clear()
            if addr in live:
                plan.reused_live_addresses += 1
            live.add(addr)
            append((OP_ALLOC, addr, size))
        elif code == skipped:
            continue
        elif code == free_code:
            if pending:
                flush()
            if addr in live:
                live.discard(addr)
                append((OP_FREE, addr, 0))
                plan.frees += 1
            else:
                plan.unknown_frees += 1
        elif code in GROW:
            pending.append((code, GROW[code], size))
            if code == SEGMENT_ALLOC:
                segments.add(addr)
                plan.segment_addresses.append((addr, size))
        elif code in SHRINK:
            pending.append((code, SHRINK[code], size))
            if code == SEGMENT_FREE:
                if addr in segments:
                    segments.discard(addr)
                else:
                    plan.unknown_segment_frees += 1
        elif code == OOM:
            grows = [p for p in pending if p[0] in GROW]
            if len(grows) < len(pending) and not gc_active:
                pending[:] = [p for p in pending if p[0] not in GROW]
                flush()
                pending[:] = grows
            expected.extend((len(ops), action, nbytes) for _, action, nbytes in pending)
            pending.clear()
            append((OP_OOM, 0, size))
            plan.ooms += 1
        elif code == SNAPSHOT:
            flush()
            append((OP_CHECKPOINT, 0, 0))
            plan.checkpoints += 1
    plan.allocs = sum(1 for op in ops if op[0] == OP_ALLOC)
    flush()
    return plan


@dataclass
class ConfigReplay:
    """One setting's replay: counters at every checkpoint, the peak and the end."""

    config: str
    checkpoints: list[list[int]]
    peak_reserved: int
    final: list[int]
    ooms: int
    segment_events: list[SegmentEvent] | None = None
    timeline: list[tuple[int, int]] | None = None

    def as_json(self) -> dict[str, Any]:
        return {"checkpoints": self.checkpoints, "peak_reserved": self.peak_reserved,
                "num_device_alloc": self.final[2], "final_reserved": self.final[0]}


class Replayer:
    """A simulator that runs plan ops one at a time (replay_plan, and plan_trace's look at the allocator)."""

    def __init__(self, config: str, capacity_bytes: int | None = None, address_space: Any = None) -> None:
        self.sim = CachingAllocatorSim(config, capacity_bytes=capacity_bytes, address_space=address_space)
        self.capacity_bytes = capacity_bytes
        self.live: dict[int, int] = {}
        self.checkpoints: list[list[int]] = []
        self.peak = 0
        self.ooms = 0

    def counters(self) -> list[int]:
        sim = self.sim
        return [sim.reserved_bytes, sim.allocated_bytes, sim.num_device_alloc, sim.num_device_free]

    def step(self, code: int, addr: int, size: int) -> None:
        sim = self.sim
        if code == OP_ALLOC:
            try:
                self.live[addr] = sim.malloc(size)
            except SimulatedOutOfMemoryError:
                self.ooms += 1  # the block does not exist here; its free is skipped
            if sim.reserved_bytes > self.peak:
                self.peak = sim.reserved_bytes
        elif code == OP_FREE:
            handle = self.live.pop(addr, None)
            if handle is not None:
                sim.free(handle)
        elif code == OP_EMPTY_CACHE:
            sim.empty_cache()
        elif code == OP_CHECKPOINT:
            self.checkpoints.append(self.counters())
        elif self.capacity_bytes is not None:  # OP_OOM: the real malloc failed; does this one?
            try:
                sim.free(sim.malloc(size))
            except SimulatedOutOfMemoryError:
                self.ooms += 1
            self.peak = max(self.peak, sim.reserved_bytes)


def replay_plan(plan: ReplayPlan, config: str, *, capacity_bytes: int | None = None, record_calls: bool = False,
                timeline: bool = False, recorded_addresses: bool = False) -> ConfigReplay:
    """Run the plan's ops on a fresh simulator with `config`.

    recorded_addresses: give segments the trace's own cudaMalloc addresses (TraceAddresses): for the
    replay under the recorded settings.
    """
    space = TraceAddresses(plan.segment_addresses) if recorded_addresses else None
    replayer = Replayer(config, capacity_bytes, space)
    sim = replayer.sim
    calls: list[tuple[str, int, int]] = []
    got: list[SegmentEvent] | None = [] if record_calls else None
    if record_calls:
        sim.device_calls = calls
    line: list[tuple[int, int]] | None = [(0, 0)] if timeline else None
    step = replayer.step
    for index, (code, addr, size) in enumerate(plan.ops):
        step(code, addr, size)
        if got is not None and calls:
            got.extend((index, action, nbytes) for action, _, nbytes in calls)
            calls.clear()
        if line is not None and sim.reserved_bytes != line[-1][1]:
            line.append((index, sim.reserved_bytes))
    return ConfigReplay(config, replayer.checkpoints, replayer.peak, replayer.counters(), replayer.ooms, got, line)


def first_difference(expected: list[SegmentEvent], got: list[SegmentEvent]) -> dict[str, Any] | None:
    for i in range(max(len(expected), len(got))):
        want = expected[i] if i < len(expected) else None
        have = got[i] if i < len(got) else None
        if want != have:
            return {"index": i, "trace": list(want) if want else None, "replay": list(have) if have else None}
    return None


@dataclass
class WhatIf:
    """Everything `memtel whatif` reports: the trace's checks and each setting's replay."""

    trace: MemoryTrace
    plan: ReplayPlan
    recorded_key: str
    replays: dict[str, ConfigReplay]
    segment_difference: dict[str, Any] | None
    incomplete: list[str]
    notes: list[str]

    @property
    def reproduces_segment_events(self) -> bool:
        return self.segment_difference is None

    def as_json(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "trace": {
                "device": self.trace.device, "events": len(self.trace.events), "allocs": plan.allocs,
                "frees": plan.frees, "checkpoints": plan.checkpoints, "inferred_empty_cache": plan.empty_caches,
                "ooms": plan.ooms, "recorded_config": self.recorded_key, "effective_config": self.trace.effective_conf,
                "segment_events": len(plan.expected), "reproduces_segment_events": self.reproduces_segment_events,
                "first_difference": self.segment_difference, "complete": not self.incomplete,
                "incomplete": self.incomplete, "incomplete_means": INCOMPLETE_MEANING if self.incomplete else None,
                "notes": self.notes,
            },
            "configs": {key: replay.as_json() for key, replay in self.replays.items()},
        }


def whatif(trace: MemoryTrace, configs: list[str], *, capacity_bytes: int | None = None,
           timeline: bool = False) -> WhatIf:
    """Replay `trace` under its recorded settings and under each of `configs` (PYTORCH_CUDA_ALLOC_CONF strings)."""
    effective = parse_alloc_conf(trace.effective_conf)
    gc_active = effective.garbage_collection_threshold > 0 and effective.per_process_memory_fraction is not None
    for config in configs:
        parse_alloc_conf(config)  # a bad setting fails before any replay
    plan = plan_trace(trace, gc_active, trace.effective_conf, capacity_bytes)
    recorded = replay_plan(plan, trace.effective_conf, capacity_bytes=capacity_bytes, record_calls=True,
                           timeline=timeline, recorded_addresses=True)
    key = trace.recorded_conf
    replays = {key: recorded}
    for config in configs:
        if config not in replays:
            # the trace's addresses while this setting makes the same cudaMallocs: the same driver gives the same
            # addresses to the same calls, and equal-size blocks are taken by address (TraceAddresses)
            replays[config] = replay_plan(plan, config, capacity_bytes=capacity_bytes, timeline=timeline,
                                          recorded_addresses=True)
    notes = list(trace.notes)
    if trace.effective_conf != trace.recorded_conf:
        notes.append(f"the allocator ran with {trace.effective_conf!r} (its recorded fields), which the recorded "
                     f"string {trace.recorded_conf!r} does not say in full: replayed with the former")
    if effective.garbage_collection_threshold > 0 and effective.per_process_memory_fraction is None:
        notes.append("the recorded settings collect garbage, which acts only under a memory fraction; a fraction set "
                     "with torch.cuda.set_per_process_memory_fraction() is not in the file: give it as "
                     "--config '<settings>,per_process_memory_fraction:F' to model it")
    for config in dict.fromkeys(configs):  # issue 19 item 11: a setting that cannot act is said, not silently replayed
        asked = parse_alloc_conf(config)
        if asked.garbage_collection_threshold > 0 and asked.per_process_memory_fraction is None:
            notes.append(f"--config {config!r}: garbage_collection_threshold does nothing without a memory fraction "
                         "(PyTorch collects only under per_process_memory_fraction): replayed as without it; add "
                         "',per_process_memory_fraction:F' to model the collection")
    if plan.empty_caches:
        notes.append(f"{plan.empty_caches} empty_cache() calls inferred from device frees no allocation caused")
    if plan.ooms:
        notes.append(f"the recorded run ran out of memory {plan.ooms} times" +
                     ("" if capacity_bytes else "; give --capacity-gb (the device's memory) to replay that"))
    if plan.frees_from_requested:
        notes.append("the history has no free_completed events (skip_actions): free_requested is used instead")
    incomplete = []
    if plan.unknown_frees:
        incomplete.append(f"{plan.unknown_frees:,} frees of blocks the history never allocated")
    if plan.unknown_segment_frees:
        incomplete.append(f"{plan.unknown_segment_frees:,} cudaFrees of segments the history never allocated")
    if plan.reused_live_addresses:
        incomplete.append(f"{plan.reused_live_addresses:,} allocations at an address that was still allocated "
                          "(their frees are missing)")
    final = trace.final
    if final is not None and plan.checkpoints:
        real = final.counters
        end = recorded.final
        if (real.reserved_bytes, real.allocated_bytes) != (end[0], end[1]):
            incomplete.append(f"the process's snapshot at the dump holds {real.reserved_bytes:,} bytes reserved and "
                              f"{real.allocated_bytes:,} allocated; the replay under the recorded settings ends with "
                              f"{end[0]:,} and {end[1]:,}")
    difference = first_difference(plan.expected, recorded.segment_events or [])
    return WhatIf(trace, plan, key, replays, difference, incomplete, notes)


# ---- output --------------------------------------------------------------------------------------

MIB = 1024 * 1024


def _mib(n: int) -> str:
    return f"{n / MIB:,.0f}"


def _label(key: str, recorded: str) -> str:
    text = repr(key) if key else "'' (defaults)"
    return text + (" (recorded)" if key == recorded else "")


def format_table(result: WhatIf, source: str = "") -> str:
    plan, trace = result.plan, result.trace
    lines = [
        f"memory history{': ' + source if source else ''} (device {trace.device}, {len(trace.events):,} events: "
        f"{plan.allocs:,} allocations, {plan.frees:,} frees, {plan.checkpoints} snapshots)",
        f"recorded settings: {repr(result.recorded_key) if result.recorded_key else 'the defaults'}",
    ]
    if result.reproduces_segment_events:
        lines.append(f"check: the replay under the recorded settings makes exactly the trace's {len(plan.expected):,} "
                     "device calls (cudaMalloc / cudaFree / map / unmap, same sizes, same points)")
    else:
        d = result.segment_difference or {}
        lines.append(f"check: the replay under the recorded settings DIFFERS from the trace's device calls at call "
                     f"{d.get('index')}: trace {d.get('trace')}, replay {d.get('replay')} (op index, call, bytes)")
    if result.incomplete:
        lines.append("INCOMPLETE history: " + "; ".join(result.incomplete))
        lines.append("  what it means: " + INCOMPLETE_MEANING)
    else:
        lines.append("complete: every free and cudaFree is of something the history allocated, and the replay ends "
                     "where the process's snapshot does")
    for note in result.notes:
        lines.append(f"note: {note}")
    width = max(len(_label(k, result.recorded_key)) for k in result.replays) + 2
    lines += ["", f"{'settings':<{width}} {'peak reserved':>14} {'final reserved':>15} {'cudaMallocs':>11}  (MiB)"]
    for key, replay in result.replays.items():
        oom = f"  {replay.ooms} out of memory" if replay.ooms else ""
        lines.append(f"{_label(key, result.recorded_key):<{width}} {_mib(replay.peak_reserved):>14} "
                     f"{_mib(replay.final[0]):>15} {replay.final[2]:>11}{oom}")
    if plan.checkpoints:
        keys = list(result.replays)
        lines += ["", "at each snapshot: reserved / allocated MiB, cudaMallocs"]
        header = "  #  " + "  ".join(f"{_label(k, result.recorded_key)[:30]:>30}" for k in keys)
        lines.append(header)
        for i in range(plan.checkpoints):
            cells = []
            for k in keys:
                row = result.replays[k].checkpoints[i]
                cells.append(f"{_mib(row[0]) + ' / ' + _mib(row[1]) + ', ' + str(row[2]):>30}")
            lines.append(f"{i + 1:>3}  " + "  ".join(cells))
    return "\n".join(lines)


def write_plot(result: WhatIf, path: Any) -> None:
    """Reserved bytes over the trace, one line per setting (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    end = len(result.plan.ops)
    for key, replay in result.replays.items():
        points = [*(replay.timeline or [(0, 0)]), (end, replay.final[0])]
        ax.step([p[0] for p in points], [p[1] / 1024**3 for p in points], where="post",
                label=_label(key, result.recorded_key))
    for i, (code, _, _) in enumerate(result.plan.ops):
        if code == OP_CHECKPOINT:
            ax.axvline(i, color="grey", alpha=0.25, linewidth=0.8)
    ax.set_xlabel("allocator event (alloc, free, empty_cache, snapshot) in trace order")
    ax.set_ylabel("reserved (GiB)")
    ax.set_title("what-if replay of a recorded memory history: reserved memory per allocator setting")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["INCOMPLETE_MEANING", "ConfigReplay", "ReplayPlan", "WhatIf", "empty_cache_explains", "format_table",
           "plan_trace", "replay_plan", "whatif", "write_plot"]
