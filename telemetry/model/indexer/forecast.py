"""Forecast the next prefill from a live allocator: `forecast()` and `memtel forecast`.

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

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from telemetry.allocator_counters import AllocatorCounters
from telemetry.errors import ConfigError
from telemetry.model.allocsim.simulator import CachingAllocatorSim, SimulatedOutOfMemoryError
from telemetry.model.allocsim.snapshot import AllocatorState, seeded_simulator
from telemetry.model.indexer.planner import MODES, ChunkStep, Launch, Mode, check_mode
from telemetry.model.indexer.prefill import LaunchPattern, PrefillObserver, run_prefill
from telemetry.model.indexer.shape import FLOAT32_BYTES, MIB, IndexerShape


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


# ---- command line --------------------------------------------------------------------------------


def _token_list(text: str) -> list[int]:
    from telemetry.argtypes import shown
    from telemetry.limits import MAX_FORECAST_TOKEN_COUNTS, MAX_PREFILL_TOKENS

    expected = (f"positive token counts separated by commas (at most {MAX_FORECAST_TOKEN_COUNTS}, each at most "
                f"{MAX_PREFILL_TOKENS:,}), got {shown(text)}")
    parts = text.split(",")
    if len(parts) > MAX_FORECAST_TOKEN_COUNTS:
        raise argparse.ArgumentTypeError(f"expected {expected}")
    values = []
    for part in parts:
        part = part.strip().replace("_", "")
        if not (part.isascii() and part.isdigit()) or len(part) > 8 or not 1 <= int(part) <= MAX_PREFILL_TOKENS:
            raise argparse.ArgumentTypeError(f"expected {expected}")
        values.append(int(part))
    return values


def configure(parser: argparse.ArgumentParser) -> None:
    from telemetry.argtypes import bounded_float
    from telemetry.limits import MAX_CAPACITY_GIB, MAX_TRANSIENT_MIB
    from telemetry.model.allocsim.cli import add_snapshot_arguments
    from telemetry.model.indexer.shape import add_shape_arguments

    parser.add_argument("--snapshot", type=Path, required=True, metavar="SNAP",
                        help="the process's allocator state: torch.cuda.memory_snapshot() saved as JSON, or a "
                             "torch.cuda.memory._dump_snapshot() pickle")
    parser.add_argument("--tokens", type=_token_list, default=None, metavar="N[,N...]",
                        help="prefill lengths to forecast, e.g. 100000,200000 (required unless --max-fit)")
    parser.add_argument("--max-fit", action="store_true",
                        help="print the longest prefill (up to --max-model-len) that, with every shorter one, fits in "
                             "--capacity-gb: what the hook's memtel_forecast_max_prefill_tokens says for that limit")
    add_shape_arguments(parser, fixed_width=True, topk=True)
    # --arm, as in `memtel replay` and `memtel lab serve`; --mode is kept as a hidden alias (issue 19 item 11).
    parser.add_argument("--arm", dest="mode", choices=MODES, default="stock",
                        help="logits width: stock (the kv length) or fixed (the padded width); default stock")
    parser.add_argument("--mode", dest="mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--alloc-conf", default=None,
                        help="the process's PYTORCH_CUDA_ALLOC_CONF (default: the snapshot's recorded settings, "
                             "else the defaults)")
    parser.add_argument("--keep-previous", action=argparse.BooleanOptionalAction, default=True,
                        help="keep the previous launch's logits alive while the next allocates (default: yes)")
    parser.add_argument("--transient-mb", type=bounded_float(0, MAX_TRANSIENT_MIB), default=0.0,
                        help="one more allocation of this many MiB per launch, freed at once")
    parser.add_argument("--capacity-gb", type=bounded_float(0, MAX_CAPACITY_GIB, above_minimum=True), default=None,
                        help="the device memory the allocator may reserve, in GiB (default: unlimited)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    add_snapshot_arguments(parser)


def _mib(n: int, sign: bool = False) -> str:
    return f"{n / MIB:{'+' if sign else ''},.0f} MiB"


def format_table(state: AllocatorState, shape: IndexerShape, results: list[Forecast], source: str) -> str:
    start = state.counters
    first = results[0]
    live = state.live_blocks()
    lines = [
        f"snapshot: {source} (device {state.device}: {_mib(start.reserved_bytes)} reserved, "
        f"{_mib(start.allocated_bytes)} allocated, {len(state.segments)} segments, {live} live blocks)",
        f"settings: {first.alloc_conf or 'defaults'!r}; {first.mode} width; {shape.layers} layers, "
        f"{shape.chunk:,}-token chunks, ratio {shape.compress_ratio}, budget {shape.logits_budget_mib:g} MiB"
        + (f", fixed width {shape.padded_width:,}" if first.mode == "fixed" else "")
        + (f", top-k {shape.topk}" if shape.topk else ""),
        "",
        f"{'tokens':>10} {'reserved growth':>16} {'peak reserved':>14} {'cudaMallocs':>11}  "
        "chunk steps with growth (step @ tokens: MiB)",
    ]
    for f in results:
        steps = ", ".join(f"{s.step} @ {s.tokens:,}: {s.growth_bytes / MIB:+,.0f}" for s in f.growth_steps) or "none"
        oom = "  OUT OF MEMORY" if f.out_of_memory else ""
        lines.append(f"{f.tokens:>10,} {_mib(f.reserved_growth_bytes, True):>16} {_mib(f.peak_reserved_bytes):>14} "
                     f"{f.num_device_alloc:>11}  {steps}{oom}")
    for note in state.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from telemetry.model.allocsim.cli import GIB, max_file_bytes, write_stdout
    from telemetry.model.allocsim.config import parse_alloc_conf
    from telemetry.model.allocsim.snapshot import load_allocator_state
    from telemetry.model.indexer.shape import shape_from_args

    if args.tokens is None and not args.max_fit:
        raise ConfigError("give --tokens N[,N...] (prefill lengths to forecast), --max-fit, or both")
    if args.max_fit and args.capacity_gb is None:
        raise ConfigError("--max-fit needs --capacity-gb X: the memory the allocator may reserve in all, in GiB")
    shape = shape_from_args(args)
    if args.alloc_conf is not None:
        parse_alloc_conf(args.alloc_conf)
    pattern = LaunchPattern(keep_previous=args.keep_previous, transient_bytes=int(args.transient_mb * MIB))
    capacity = int(args.capacity_gb * GIB) if args.capacity_gb is not None else None
    state = load_allocator_state(args.snapshot, device=args.device, max_bytes=max_file_bytes(args),
                                 max_objects=args.max_objects, max_blocks=args.max_blocks)
    results = [forecast(state, shape, n, mode=args.mode, alloc_conf=args.alloc_conf, pattern=pattern,
                        capacity_bytes=capacity) for n in args.tokens or ()]
    fit = None
    if args.max_fit and capacity is not None:
        from telemetry.model.indexer.fit import max_prefill_tokens

        fit = max_prefill_tokens(state, shape, limit_bytes=capacity, mode=args.mode, alloc_conf=args.alloc_conf,
                                 pattern=pattern)
    if args.json:
        doc: dict[str, Any] = {"snapshot": str(args.snapshot), "device": state.device, "shape": shape.as_dict(),
                               "notes": list(state.notes), "forecasts": [f.as_json() for f in results]}
        if fit is not None:
            doc["max_fit"] = fit.as_json()
        write_stdout(json.dumps(doc, indent=1))
    else:
        text = format_table(state, shape, results, str(args.snapshot)) if results else ""
        if fit is not None:
            text = (text + "\n\n" if text else "") + format_fit(fit)
        write_stdout(text)
    return 0


def format_fit(fit: Any) -> str:
    """The longest prefill that fits, in one paragraph."""
    head = (f"longest prefill that fits in {_mib(fit.limit_bytes)} (reserved now {_mib(fit.start_reserved_bytes)}): "
            f"{fit.tokens:,} tokens")
    if fit.tokens:
        head += f", peak reserved {_mib(fit.peak_reserved_bytes)}"
    if fit.first_misfit is not None:
        head += f"; {fit.first_misfit:,} tokens run out of memory"
    else:
        head += f" (every length up to max-model-len {fit.max_tokens:,} fits)"
    return head + f" [{fit.simulations} simulated prefills]"


__all__ = ["Forecast", "GrowthStep", "forecast", "simulate_prefill"]
