"""Forecast the next prefill from a live allocator: `forecast()` (`memtel forecast` is forecast_cli.py).

A simulator is seeded with a process's real allocator state (a `torch.cuda.memory_snapshot()`,
telemetry/model/allocsim/snapshot.py) and runs the indexer's launch loop (`telemetry.model.indexer.prefill.run_prefill`)
for a prefill of N tokens: the answer is how many bytes the allocator would add (reserved growth),
its peak, the cudaMallocs, and the chunk steps where the growth happens. The snapshot's live blocks
stay live, its cached free blocks are reused, and new segments continue from the real addresses.

`forecast(state, shape, tokens)` is the library call (the hook's forecast thread takes
`torch.cuda.memory_snapshot()`, reads it with `read_allocator_state` and calls it for each N).
It never touches the hook target: the simulated launches allocate on the simulator directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from telemetry.allocator_counters import AllocatorCounters
from telemetry.errors import ConfigError
from telemetry.model.allocsim.simulator import CachingAllocatorSim, SimulatedOutOfMemoryError
from telemetry.model.allocsim.snapshot import AllocatorState, seeded_simulator
from telemetry.model.indexer.planner import ChunkStep, Launch, Mode, check_mode
from telemetry.model.indexer.prefill import LaunchPattern, PrefillObserver, run_prefill
from telemetry.model.indexer.shape import FLOAT32_BYTES, IndexerShape


@dataclass(frozen=True)
class GrowthStep:
    """A chunk step in which reserved memory grew."""

    step: int
    tokens: int  # prompt tokens processed by the end of this step
    growth_bytes: int
    num_device_alloc: int


@dataclass(frozen=True)
class Forecast:
    """What the allocator would do during a prefill of `tokens`, from the snapshot's state.

    reserved_growth_bytes: reserved at the end of the prefill minus at the snapshot (what stays).
    peak_reserved_bytes: the highest reserved during the prefill (absolute, as the process counts it).
    peak_growth_bytes: that peak minus the snapshot's reserved bytes (what must fit at once).
    num_device_alloc / num_device_free: cudaMallocs (expandable: map calls) and frees during the prefill.
    out_of_memory: the prefill could not finish within `capacity_bytes` (figures up to the failure).
    """

    tokens: int
    mode: str
    alloc_conf: str
    start: AllocatorCounters
    reserved_growth_bytes: int
    peak_reserved_bytes: int
    peak_growth_bytes: int
    num_device_alloc: int
    num_device_free: int
    growth_steps: tuple[GrowthStep, ...] = field(default=())
    out_of_memory: bool = False

    def as_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "mode": self.mode, "alloc_conf": self.alloc_conf,
                "start_reserved_bytes": self.start.reserved_bytes, "start_allocated_bytes": self.start.allocated_bytes,
                "reserved_growth_bytes": self.reserved_growth_bytes, "peak_reserved_bytes": self.peak_reserved_bytes,
                "peak_growth_bytes": self.peak_growth_bytes, "num_device_alloc": self.num_device_alloc,
                "num_device_free": self.num_device_free, "out_of_memory": self.out_of_memory,
                "growth_steps": [vars(s) for s in self.growth_steps]}


class _SeededBackend:
    """The launch loop's backend on a seeded simulator (LaunchBackend), without the hook target."""

    name = "sim"

    def __init__(self, sim: CachingAllocatorSim) -> None:
        self.sim = sim

    def launch(self, rows: int, width: int, kv_len: int) -> object:
        return self.sim.malloc(rows * width * FLOAT32_BYTES)

    def alloc(self, nbytes: int) -> object:
        return self.sim.malloc(nbytes)

    def release(self, allocation: object) -> None:
        self.sim.free(allocation)  # type: ignore[arg-type]

    def counters(self) -> AllocatorCounters:
        return AllocatorCounters.from_mapping(self.sim.stats())

    def finish(self) -> None:
        """Nothing is in flight on a simulator."""

    def close(self) -> None:
        """Nothing to release."""

    def describe(self) -> dict[str, Any]:
        return {"allocator": "sim", "seeded": True}


class _Watch(PrefillObserver):
    def __init__(self, sim: CachingAllocatorSim, pause: Callable[[], None] | None = None) -> None:
        self.sim = sim
        self.pause = pause
        self.peak = sim.reserved_bytes
        self.steps: list[GrowthStep] = []
        self._at_step = (sim.reserved_bytes, sim.num_device_alloc)
        self.step = -1                       # the chunk step under way (its index), -1 before the first
        self.step_peaks: list[int] = []      # the peak reserved through the end of each chunk step
        self.step_reserved: list[int] = []   # reserved at the start of each chunk step

    def step_started(self, step: ChunkStep, launches: list[Launch]) -> None:
        self._at_step = (self.sim.reserved_bytes, self.sim.num_device_alloc)
        self.step = step.index
        self.step_reserved.append(self.sim.reserved_bytes)

    def launch_started(self, step: ChunkStep, layer: int, index: int) -> None:
        if self.pause is not None:   # the live forecast lets the serving threads run here
            self.pause()

    def op_done(self, op: list[object]) -> None:
        if op[0] == "malloc" and self.sim.reserved_bytes > self.peak:
            self.peak = self.sim.reserved_bytes

    def step_ended(self, step: ChunkStep, launches: list[Launch]) -> None:
        self.close_step(step.index, step.tokens_so_far)
        self.step_peaks.append(self.peak)

    def close_step(self, index: int, tokens: int) -> None:
        reserved, allocs = self._at_step
        growth = self.sim.reserved_bytes - reserved
        if growth or self.sim.num_device_alloc > allocs:
            self.steps.append(GrowthStep(index, tokens, growth, self.sim.num_device_alloc - allocs))


def forecast(state: AllocatorState, shape: IndexerShape, tokens: int, *, mode: Mode = "stock",
             alloc_conf: str | None = None, pattern: LaunchPattern | None = None,
             capacity_bytes: int | None = None, total_memory: int | None = None,
             pause: Callable[[], None] | None = None) -> Forecast:
    """Forecast a prefill of `tokens` from `state` (see the module's docstring).

    state: `read_allocator_state(torch.cuda.memory_snapshot(), device=...)` or `load_allocator_state(path)`.
    shape: the indexer's shape (layers, chunk, ratio, budget, fixed width, top-k).
    mode: "stock" (width = kv length) or "fixed" (the padded width).
    alloc_conf: the process's PYTORCH_CUDA_ALLOC_CONF; None: the snapshot's recorded settings, else defaults.
    capacity_bytes: the device memory the allocator may reserve (None: unlimited).
    total_memory: the device's total memory, of which `per_process_memory_fraction` is a fraction (None:
        `capacity_bytes`, else an H200's).
    pause: called before every launch of the simulated prefill (a background caller lets other threads run there).
    Raises ConfigError (SnapshotError) for a state or setting the simulator cannot start from.
    """
    return simulate_prefill(state, shape, tokens, mode=mode, alloc_conf=alloc_conf, pattern=pattern,
                            capacity_bytes=capacity_bytes, total_memory=total_memory, pause=pause)[0]


def simulate_prefill(state: AllocatorState, shape: IndexerShape, tokens: int, *, mode: Mode = "stock",
                     alloc_conf: str | None = None, pattern: LaunchPattern | None = None,
                     capacity_bytes: int | None = None, total_memory: int | None = None,
                     pause: Callable[[], None] | None = None,
                     release_cache_on_oom: bool = True) -> tuple[Forecast, _Watch]:
    """`forecast()`, with the observer that watched it: its `step` (where an out-of-memory stopped it) and
    `step_peaks` (the peak reserved through each chunk step), for the longest-prefill search (fit.py).
    release_cache_on_oom: as `CachingAllocatorSim`'s (False: `capacity_bytes` is a share the allocator does not
    see, so no cached block is freed to stay within it)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ConfigError(f"forecast tokens must be a positive integer, got {tokens!r}")
    mode = check_mode(mode)
    conf = alloc_conf if alloc_conf is not None else (state.alloc_conf or "")
    sim = seeded_simulator(state, conf, capacity_bytes=capacity_bytes, total_memory=total_memory,
                           release_cache_on_oom=release_cache_on_oom)
    start = AllocatorCounters(sim.reserved_bytes, sim.allocated_bytes, 0, 0)
    watch = _Watch(sim, pause)
    out_of_memory = False
    try:
        run_prefill(_SeededBackend(sim), shape, mode, tokens, pattern=pattern or LaunchPattern(), observer=watch)
    except SimulatedOutOfMemoryError:
        out_of_memory = True
        watch.peak = max(watch.peak, sim.reserved_bytes)
    return Forecast(tokens=tokens, mode=mode, alloc_conf=conf, start=start,
                    reserved_growth_bytes=sim.reserved_bytes - start.reserved_bytes,
                    peak_reserved_bytes=watch.peak, peak_growth_bytes=watch.peak - start.reserved_bytes,
                    num_device_alloc=sim.num_device_alloc, num_device_free=sim.num_device_free,
                    growth_steps=tuple(watch.steps), out_of_memory=out_of_memory), watch


__all__ = ["Forecast", "GrowthStep", "forecast", "simulate_prefill"]
