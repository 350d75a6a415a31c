"""`memtel forecast`: the next prefill's reserved growth from an allocator snapshot, and the longest that fits.

The library calls are forecast.py's `forecast()` and fit.py's `max_prefill_tokens()`; this module reads the
flags, loads the snapshot and prints the table (or JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from telemetry.catalogue.metrics import FORECAST_MAX_PREFILL_TOKENS
from telemetry.errors import ConfigError
from telemetry.model.allocsim.cap import CAPS, capped
from telemetry.model.allocsim.snapshot import AllocatorState
from telemetry.model.indexer.fit import MaxFit, max_prefill_tokens
from telemetry.model.indexer.forecast import Forecast, forecast
from telemetry.model.indexer.planner import MODES
from telemetry.model.indexer.prefill import LaunchPattern
from telemetry.model.indexer.shape import MIB, IndexerShape


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
    from telemetry.command_helpers import add_snapshot_arguments
    from telemetry.limits import MAX_CAPACITY_GIB, MAX_TRANSIENT_MIB
    from telemetry.model.indexer.shape import add_shape_arguments

    parser.add_argument("--snapshot", type=Path, required=True, metavar="SNAP",
                        help="the process's allocator state: torch.cuda.memory_snapshot() saved as JSON, or a "
                             "torch.cuda.memory._dump_snapshot() pickle")
    parser.add_argument("--tokens", type=_token_list, default=None, metavar="N[,N...]",
                        help="prefill lengths to forecast, e.g. 100000,200000 (required unless --max-fit)")
    parser.add_argument("--max-fit", action="store_true",
                        help="print the longest prefill (up to --max-model-len) that, with every shorter one, fits in "
                             f"--capacity-gb: what the hook's {FORECAST_MAX_PREFILL_TOKENS.series} says for that limit")
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
    parser.add_argument("--cap", choices=CAPS, default="device",
                        help="how --capacity-gb stops the allocator, as in memtel tune: device (the memory runs out; "
                             "the default) or fraction (torch's set_per_process_memory_fraction of the total memory, "
                             "checked before each new segment; garbage_collection_threshold then acts)")
    parser.add_argument("--total-memory-gb", type=bounded_float(0, MAX_CAPACITY_GIB, above_minimum=True),
                        default=None, help="the device's total memory in GiB, of which --cap fraction is a fraction "
                                           "(default: an H200's)")
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
    from telemetry.command_helpers import GIB, max_file_bytes, write_stdout
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
    total = int(args.total_memory_gb * GIB) if args.total_memory_gb is not None else None
    state = load_allocator_state(args.snapshot, device=args.device, max_bytes=max_file_bytes(args),
                                 max_objects=args.max_objects, max_blocks=args.max_blocks)
    conf = args.alloc_conf
    if args.cap == "fraction":
        if capacity is None:
            raise ConfigError("--cap fraction needs --capacity-gb X: the memory the fraction allows, in GiB")
        own = args.alloc_conf if args.alloc_conf is not None else (state.alloc_conf or "")
        if parse_alloc_conf(own).per_process_memory_fraction is not None:
            raise ConfigError("--cap fraction: the settings already set per_process_memory_fraction; give the "
                              "memory as --cap device, or that fraction's memory as --capacity-gb")
        conf, capacity, total = capped(own, capacity, "fraction", total)
    results = [forecast(state, shape, n, mode=args.mode, alloc_conf=conf, pattern=pattern,
                        capacity_bytes=capacity, total_memory=total) for n in args.tokens or ()]
    fit = None
    if args.max_fit and capacity is not None:
        fit = max_prefill_tokens(state, shape, limit_bytes=capacity, mode=args.mode, alloc_conf=conf,
                                 pattern=pattern, total_memory=total)
        if args.cap == "fraction":   # the limit the fraction sets, not the device the simulator holds it in
            fit = dataclasses.replace(fit, limit_bytes=int(args.capacity_gb * GIB))
    if args.json:
        doc: dict[str, Any] = {"snapshot": str(args.snapshot), "device": state.device, "shape": shape.as_dict(),
                               "cap": args.cap,
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


def format_fit(fit: MaxFit) -> str:
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
