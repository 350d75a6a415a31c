"""`memtel tune`: the settings under which the longest prefill fits a memory, from a process's allocator state.

    memtel tune --snapshot SNAP [--history HIST] --target-tokens N (--memory-gb X | --node-headroom) [shape flags]
                [--engine vllm|sglang|lab | --preset NAME] [--json] [--plot FILE] [--verify [K]]

With the process's allocation history (`--history`, a `--trace` recorded from the start) each setting starts
from that history replayed under it (telemetry/model/fitsearch/history.py); without it, a setting that changes the
allocator's layout is a best case, printed "at most N" and never ranked above today's setting on it alone.

The search is telemetry/model/fitsearch (pure, on the simulator); this module reads the inputs (the snapshot or a
recorded trace through `memtel forecast`'s loader and limits, the node's headroom, the engine), prints the
ranking and the lines to paste, and runs `--verify`. docs/lab.md, "Tune (`memtel tune`)".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from telemetry import hook_env
from telemetry.catalogue import metrics as catalogue
from telemetry.errors import ConfigError
from telemetry.model.indexer.shape import MIB, budget_bytes_from_mib

MAX_TOP = 100
MAX_VERIFY = 10
LIST_LIMIT = 16   # values per knob on the command line


def _list(kind: str, parse: Any, none_words: tuple[str, ...] = ("none", "unset")) -> Any:
    """An argparse type: comma-separated values, `none` for "not set" where allowed."""
    def convert(text: str) -> tuple[Any, ...]:
        from telemetry.argtypes import shown
        from telemetry.model.fitsearch.space import iter_values

        values = list(iter_values(text))
        if not values or len(values) > LIST_LIMIT:
            raise argparse.ArgumentTypeError(f"expected 1 to {LIST_LIMIT} {kind} separated by commas, "
                                             f"got {shown(text)}")
        out: list[Any] = []
        for value in values:
            if value.lower() in none_words:
                out.append(None)
                continue
            try:
                out.append(parse(value))
            except (ValueError, ConfigError):
                raise argparse.ArgumentTypeError(f"expected {kind} separated by commas, got {shown(value)}") from None
        return tuple(out)
    return convert


def _int(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 9:
        raise ValueError(text)
    return int(text)


def _mode(text: str) -> str:
    from telemetry.model.indexer.planner import MODES

    if text not in MODES:
        raise ValueError(text)
    return text


def _bool(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise ValueError(text)
    return text.lower() == "true"


def configure(parser: argparse.ArgumentParser) -> None:
    from telemetry.argtypes import bounded_float, bounded_int
    from telemetry.command_helpers import add_snapshot_arguments
    from telemetry.limits import MAX_CAPACITY_GIB, MAX_PREFILL_TOKENS
    from telemetry.model.indexer.planner import MODES
    from telemetry.model.indexer.shape import add_shape_arguments
    from telemetry.tune.engines import ENGINES

    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--snapshot", type=Path, metavar="SNAP",
                        help="the process's allocator state: torch.cuda.memory_snapshot() saved as JSON, or a "
                             "torch.cuda.memory._dump_snapshot() pickle")
    source.add_argument("--trace", type=Path, metavar="TRACE",
                        help="a recorded memory history (torch.cuda.memory._dump_snapshot() pickle): the state at "
                             "its end")
    source.add_argument("--hook", metavar="URL",
                        help="a live hook's exporter (HOST:PORT or http(s)://[USER:PASSWORD@]HOST:PORT): its rank's "
                             "allocator state now, from /snapshot, with what its live forecast knows: the workload "
                             "(shape, width, scale: the shape flags are not used then), the settings and the fit "
                             "budget (the memory unless --memory-gb or --node-headroom), and its history where it "
                             "keeps one")
    parser.add_argument("--history", type=Path, default=None, metavar="HIST",
                        help="the process's allocation history up to the snapshot: a torch memory history "
                             "(torch.cuda.memory._dump_snapshot() pickle after _record_memory_history() from the "
                             "start) or a JSON list of [\"a\", id, bytes] / [\"f\", id]; each setting is then "
                             "searched from the history replayed under it (exact), not from the snapshot's blocks "
                             "(a best case)")
    parser.add_argument("--max-history-ops", type=bounded_int(1, 10**9), default=None, metavar="N",
                        help="refuse a history of more ops than this (default 2,000,000)")
    parser.add_argument("--target-tokens", type=bounded_int(1, MAX_PREFILL_TOKENS), required=True, metavar="N",
                        help="the prefill length that matters: the peak and launches are shown at it")
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument("--memory-gb", type=bounded_float(0, MAX_CAPACITY_GIB, above_minimum=True), default=None,
                        help="the memory the allocator may reserve in all, in GiB")
    memory.add_argument("--node-headroom", action="store_true",
                        help="the node's headroom now (unified memory: min(MemAvailable, free 2 MiB blocks)) less "
                             f"{hook_env.GUARD_RESERVE_MB}, shared by LOCAL_WORLD_SIZE ranks, on top of the state's "
                             "reserved bytes (as the hook's fit budget)")
    engine = parser.add_mutually_exclusive_group()
    engine.add_argument("--engine", choices=sorted(ENGINES), default=None,
                        help="whose switches to search and print (default vllm)")
    engine.add_argument("--preset", default=None, metavar="NAME",
                        help="the engine by its hook preset: "
                        + ", ".join(e.tuning.preset for e in ENGINES.values() if e.tuning))
    add_shape_arguments(parser, fixed_width=True, topk=True)
    parser.add_argument("--arm", dest="mode", choices=MODES, default="stock",
                        help="the process's logits width today: stock or fixed (default stock)")
    parser.add_argument("--alloc-conf", default=None,
                        help="the process's PYTORCH_CUDA_ALLOC_CONF (default: the snapshot's recorded settings, "
                             "else the defaults)")
    parser.add_argument("--keep-previous", action=argparse.BooleanOptionalAction, default=True,
                        help="keep the previous launch's logits alive while the next allocates (default: yes)")
    parser.add_argument("--total-memory-gb", type=bounded_float(0, MAX_CAPACITY_GIB, above_minimum=True),
                        default=None, help="the device's total memory in GiB (a memory fraction's base and the "
                                           "engine share's; default with --node-headroom: MemTotal)")
    parser.add_argument("--cap", choices=("device", "fraction"), default=None,
                        help="how the memory stops the allocator: device (the memory runs out; the default) or "
                             "fraction (torch's set_per_process_memory_fraction of the total memory, which checks a "
                             "new segment's size before mapping it; the default with --verify on cuda, which caps "
                             "its probes so)")
    parser.add_argument("--gpu-memory-utilization", type=bounded_float(0, 1, above_minimum=True), default=None,
                        metavar="U", help="the engine's memory share today (vLLM's gpu_memory_utilization, SGLang's "
                                          "mem_fraction_static): with the total memory, tune suggests the share that "
                                          "leaves the target prefill room")
    space = parser.add_argument_group("search space (comma-separated; 'none' = not set)")
    space.add_argument("--expandable-segments", type=_list("True/False", _bool, ()), default=None, metavar="B,...",
                       help="default True,False")
    space.add_argument("--max-split-mb", type=_list("integers (MiB, at least 20) or none", _int), default=None,
                       metavar="N,...", help="max_split_size_mb values (default none,128,512)")
    space.add_argument("--roundup", type=_list("powers of two or none", _int), default=None, metavar="N,...",
                       help="roundup_power2_divisions values (default none,2,8)")
    space.add_argument("--gc-threshold", type=_list("numbers in (0, 1) or none", float), default=None,
                       metavar="T,...", help="garbage_collection_threshold values (default none,0.6,0.8; only under "
                                             "a per_process_memory_fraction)")
    space.add_argument("--budgets-mb", type=_list("MiB", lambda t: budget_bytes_from_mib(float(t)), ()), default=None,
                       metavar="MB,...", help="logits budgets (default 128,256,512,1024,2048)")
    space.add_argument("--chunks", type=_list("token counts", _int, ()), default=None, metavar="N,...",
                       help="prefill chunks, max-num-batched-tokens (default 2048,4096,8192,16384)")
    space.add_argument("--modes", type=_list("stock/fixed", _mode, ()),
                       default=None, metavar="M,...", help="logits widths (default stock,fixed)")
    parser.add_argument("--top", type=bounded_int(1, MAX_TOP), default=None, help="settings ranked in full (default 5)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE",
                        help="write a plot of the longest fit per setting (PNG; needs matplotlib: memtel[harness])")
    parser.add_argument("--verify", type=bounded_int(0, MAX_VERIFY), nargs="?", const=3, default=0, metavar="K",
                        help="run the top K settings (default 3) and the process's own for real, a fresh process per "
                             "prefill, and print predicted against real")
    parser.add_argument("--verify-allocator", choices=("sim", "cuda"), default=None,
                        help="where --verify runs: cuda (a GPU here) or sim (the lab's simulated allocator); default "
                             "cuda when torch sees a GPU")
    add_snapshot_arguments(parser)


def _space(args: argparse.Namespace, engine: Any) -> Any:
    from telemetry.model.fitsearch.space import SearchSpace

    defaults = SearchSpace()
    gc = args.gc_threshold
    if gc is not None:
        gc = tuple(None if t is None else float(t) for t in gc)
    budgets = defaults.budgets_bytes if args.budgets_mb is None else tuple(args.budgets_mb)
    if not engine.tuning.budget_is_setting:
        if args.budgets_mb is not None:
            raise ConfigError(f"--budgets-mb: {engine.name} sizes the logits budget itself from free memory, so it is "
                              "not searched (give the budget it reaches with --budget-mb)")
        budgets = None
    return SearchSpace(
        expandable_segments=args.expandable_segments or defaults.expandable_segments,
        max_split_size_mb=args.max_split_mb or defaults.max_split_size_mb,
        roundup_power2_divisions=args.roundup or defaults.roundup_power2_divisions,
        garbage_collection_threshold=gc or defaults.garbage_collection_threshold,
        budgets_bytes=budgets, chunks=args.chunks or defaults.chunks, modes=args.modes or defaults.modes)


def _limit(args: argparse.Namespace, state: Any) -> tuple[int, bool, str, int | None]:
    """(limit bytes, release cache on OOM, how it was read, the total memory if this read it)."""
    counters = state.counters
    if args.memory_gb is not None:
        return int(args.memory_gb * 1024**3), True, f"--memory-gb {args.memory_gb:g}", None
    from telemetry.fit_budget import node_headroom, reserve_bytes, sharing_ranks, unified_base
    from telemetry.procfs.meminfo import parse_meminfo

    try:
        headroom = node_headroom()
        with open("/proc/meminfo", encoding="ascii", errors="replace") as f:
            total = parse_meminfo(f.read(65536)).get("MemTotal")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--node-headroom: cannot read the node's memory ({exc}); give --memory-gb") from None
    base = unified_base(headroom, reserve=reserve_bytes(), ranks=sharing_ranks())
    budget = base.for_allocator(counters.allocated_bytes, counters.reserved_bytes)
    return budget.limit_bytes, not budget.shared, f"the node's headroom: {budget.detail}", total


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:,.0f} MiB"


def format_result(result: Any, engine: Any, source: str, limit_text: str, utilization: float | None,
                  lines: list[str]) -> str:
    problem = result.problem
    state = problem.state
    c = state.counters
    out = [f"state: {source} (device {state.device}: {_mib(c.reserved_bytes)} reserved, {_mib(c.allocated_bytes)} "
           f"allocated, {len(state.segments)} segments; settings {state.alloc_conf or 'defaults'!r})",
           f"memory: the allocator may reserve {_mib(problem.limit_bytes)} ({limit_text}); target "
           f"{problem.target_tokens:,} tokens; max-model-len {problem.base.max_model_len:,}",
           f"searched {result.settings} settings: {len(result.ranked)} in full, {len(result.pruned)} ruled out; "
           f"{result.simulations:,} simulated prefills, {result.cpu_seconds:.1f} s CPU", "",
           f"{'rank':>4} {'longest fit':>12} {'peak @ target':>14} {'device allocs':>13} {'launches':>9}  setting"]

    def row(rank: str, o: Any) -> str:
        fit = (f"at most {o.fit.tokens:,}" if o.fit is not None and o.best_case
               else f"{o.fit.tokens:,}" if o.fit is not None else f"<= {o.fit_at_most:,}")
        t = o.target
        peak = "-" if t is None else ("OOM" if t.out_of_memory else _mib(t.peak_reserved_bytes))
        allocs = "-" if t is None or t.out_of_memory else f"{t.num_device_alloc:,}"
        return f"{rank:>4} {fit:>12} {peak:>14} {allocs:>13} {o.launches:>9,}  {o.setting.label()}"

    out += [row(str(i + 1), o) for i, o in enumerate(result.ranked)]
    out.append(row("now", result.process))
    best, mine = result.best, result.process
    out += ["", f"best: {best.setting.label()}: longest prefill {best.fit_tokens:,} tokens "
                f"(today {mine.fit_tokens:,}, {best.fit_tokens - mine.fit_tokens:+,}); "
                f"launches per {problem.target_tokens:,}-token prefill {best.launches:,} (today {mine.launches:,})"]
    if utilization is not None and engine.tuning.utilization_flag:
        out.append(f"{engine.tuning.utilization_flag} {utilization:.2f}: the largest share that leaves a target "
                   "prefill room within the limit (assumes the state's reserved memory is what today's share covers; "
                   "check that the KV cache still holds the target's tokens)")
    out += [f"lines to paste ({engine.name}):", *(f"  {line}" for line in lines)]
    if any(o.best_case for o in result.ranked):
        out.append("best case: without the process's allocation history, a setting that changes the allocator's "
                   "layout is searched from the snapshot's live blocks as they lie (\"at most N\": the history may "
                   "leave free memory trapped in its segments) and is not ranked above today's on that alone; for "
                   "the exact answer pass --history (a torch memory history recorded from the start, or the "
                   "hook's /snapshot with its history)")
    elif problem.history is not None:
        out.append(f"history: {problem.history.source}, {len(problem.history.ops):,} ops replayed under each "
                   "setting from the process's start")
    out += [f"left out: {note}" for note in result.left_out]
    out += [f"note: {note}" for note in (*state.notes, *result.notes)]
    out.append("not searched: values outside the space's lists, max_non_split_rounding_mb, "
               "per_process_memory_fraction and the backend (kept as the process has them), private pools, CUDA "
               "graphs, the model's own activations of a larger chunk, the KV cache per token; "
               + ("the history's ops are replayed as recorded (a prefill in it keeps the chunk and budget it ran "
                  "with; empty_cache() calls are not in it)" if problem.history is not None else
                  "the state is kept as the snapshot has it and the settings apply from then on"))
    return "\n".join(out)


def format_verified(verified: list[Any], allocator: str) -> str:
    out = ["", f"verify ({allocator}; a fresh process per prefill):",
           f"{'predicted fit':>13} {'real fit':>10} {'predicted peak':>15} {'real peak':>12} {'target time':>11}  "
           "agrees  setting"]
    for v in verified:
        real = "differs" if v.real_fit is None else f"{v.real_fit:,}"
        predicted = v.outcome.target
        ppeak = ("-" if predicted is None
                 else "OOM" if predicted.out_of_memory else _mib(predicted.peak_reserved_bytes))
        rpeak = "-" if v.target is None else (_mib(v.target.peak_reserved_bytes) if v.target.fits else "OOM")
        seconds = "-" if v.target is None else f"{v.target.seconds:.3f} s"
        out.append(f"{v.outcome.fit_tokens:>13,} {real:>10} {ppeak:>15} {rpeak:>12} {seconds:>11}  "
                   f"{'yes' if v.agrees else 'NO':>6}  {v.outcome.setting.label()}")
        for probe in v.probes:
            if probe.rebuilt:
                out.append(f"  note: the rebuilt state differs from the snapshot: {probe.rebuilt}")
                break
    return "\n".join(out)


def write_plot(result: Any, path: Path) -> Path:
    """The longest fit per setting searched in full (and the process's), as horizontal bars."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ConfigError("--plot needs matplotlib, which is not installed here: install it with "
                          "pip install 'memtel[harness]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [*result.ranked, result.process]
    labels = [o.setting.label() for o in result.ranked] + [f"today: {result.process.setting.label()}"]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.5))
    ax.barh(range(len(rows)), [o.fit_tokens for o in rows], color=["C0"] * len(result.ranked) + ["C1"])
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(result.problem.target_tokens, color="k", linestyle="--", linewidth=1, label="target")
    ax.set_xlabel("longest prefill that fits (tokens)")
    ax.set_title(f"memtel tune: within {result.problem.limit_bytes / MIB:,.0f} MiB")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> int:
    from telemetry.command_helpers import max_file_bytes
    from telemetry.model.allocsim.snapshot import load_allocator_state
    from telemetry.model.indexer.shape import shape_from_args
    from telemetry.tune.engines import ENGINES, engine_of_preset, modes

    engine = engine_of_preset(args.preset) if args.preset else ENGINES[args.engine or "vllm"]
    engine_modes = modes(engine)
    if args.mode not in engine_modes:
        raise ConfigError(f"--arm {args.mode}: {engine.name} has no switch for it (its modes: "
                          f"{', '.join(engine_modes)})")
    shape = shape_from_args(args)
    space = _space(args, engine)   # bad values first, before the file is read
    space.check()
    if args.plot is not None and args.plot.suffix.lower() != ".png":
        raise ConfigError(f"--plot {args.plot}: expected a .png file name")
    max_bytes = max_file_bytes(args)
    if args.hook is None:
        if args.memory_gb is None and not args.node_headroom:
            raise ConfigError("give the memory: --memory-gb X or --node-headroom (or --hook, whose fit budget is used)")
        path = args.snapshot or args.trace
        state = load_allocator_state(path, device=args.device, max_bytes=max_bytes, max_objects=args.max_objects,
                                     max_blocks=args.max_blocks)
        history = _history(args, path, state, max_bytes)
        return _run(args, engine, shape, space, path, str(path), state, max_bytes, history)
    from telemetry.tune.hook_snapshot import fetch_hook

    state, path, hook = fetch_hook(args.hook, device=args.device, max_bytes=max_bytes, max_objects=args.max_objects,
                                   max_blocks=args.max_blocks)
    try:
        if hook is None and args.memory_gb is None and not args.node_headroom:
            raise ConfigError(f"--hook {args.hook}: the hook serves no fit budget (its live forecast is off or has not "
                              "fit yet): give --memory-gb or --node-headroom")
        if hook is not None:
            shape = hook["shape"]
            args.mode = hook["mode"]
            if args.alloc_conf is None:
                args.alloc_conf = hook["alloc_conf"]
        history = _history(args, path, state, max_bytes)
        return _run(args, engine, shape, space, path, args.hook, state, max_bytes, history, hook)
    finally:
        path.unlink(missing_ok=True)


def _history(args: argparse.Namespace, path: Path, state: Any, max_bytes: int) -> Any:
    """The process's history: --history, else the --trace's own, else what the hook's /snapshot carried (None:
    none); checked against the snapshot's live blocks."""
    from telemetry.model.fitsearch.history import MAX_HISTORY_OPS, HistoryError, check_matches, load_history

    bound = args.max_history_ops or MAX_HISTORY_OPS
    source = args.history
    if source is None and args.snapshot is None:
        source = path   # a trace, or the hook's /snapshot document
    if source is None:
        return None
    try:
        history = load_history(source, device=args.device, max_bytes=max_bytes, max_ops=bound)
    except HistoryError:
        if args.history is not None:
            raise
        return None   # a trace that lost its start, or a hook that keeps no history: the snapshot alone
    conf = args.alloc_conf if args.alloc_conf is not None else (state.alloc_conf or "")
    check_matches(history, state, conf)
    return history


def _run(args: argparse.Namespace, engine: Any, shape: Any, space: Any, path: Path, where: str, state: Any,
         max_bytes: int, history: Any = None, hook: dict[str, Any] | None = None) -> int:
    from telemetry.command_helpers import write_stdout
    from telemetry.model.fitsearch.search import DEFAULT_TOP, Problem, suggest_utilization, tune
    from telemetry.model.fitsearch.space import expand, process_setting
    from telemetry.model.fitsearch.verify import SnapshotSource, verify
    from telemetry.model.indexer.prefill import LaunchPattern
    from telemetry.tune.engines import apply_settings, modes, paste_lines

    process_conf = args.alloc_conf if args.alloc_conf is not None else (state.alloc_conf or "")
    if hook is not None and args.memory_gb is None and not args.node_headroom:
        limit, release, node_total = hook["limit_bytes"], not hook["shared"], hook["total_memory"]
        limit_text = f"the hook's fit budget: {hook['budget']}"
    else:
        limit, release, limit_text, node_total = _limit(args, state)
    total = int(args.total_memory_gb * 1024**3) if args.total_memory_gb is not None else node_total
    allocator = None
    if args.verify:
        from telemetry.model.indexer.backends import default_allocator

        allocator = args.verify_allocator or default_allocator()
    cap = args.cap or ("fraction" if allocator == "cuda" else "device")
    if cap == "fraction" and total is None:
        raise ConfigError("--cap fraction: give the device's total memory (--total-memory-gb): the fraction is of it")
    limit_text += f"; cap: {cap}"
    pattern = hook["pattern"] if hook is not None else LaunchPattern(keep_previous=args.keep_previous)
    problem = Problem(state, shape, limit, args.target_tokens, pattern,
                      total_memory=total, release_cache_on_oom=release, cap=cap, history=history,
                      process_conf=process_conf)
    expanded = expand(space, shape, process_conf, engine_modes=modes(engine), engine_name=engine.name,
                      fraction_applies=cap == "fraction")
    mine = process_setting(shape, process_conf, args.mode)
    result = tune(problem, expanded, mine, top=args.top or DEFAULT_TOP)
    utilization = None
    if args.gpu_memory_utilization is not None and total:
        utilization = suggest_utilization(result.best, problem, args.gpu_memory_utilization, total)
    lines = paste_lines(engine, result.best.setting, utilization)
    verified = []
    if allocator is not None:
        source = SnapshotSource(str(path), args.device, max_bytes, args.max_objects, args.max_blocks)
        chosen = list(result.ranked[:args.verify])
        if result.process not in chosen:
            chosen.append(result.process)
        verified = verify(problem, source, chosen, allocator)
    if args.plot is not None:
        write_plot(result, args.plot)
    if args.json:
        doc = {"snapshot": where, "device": state.device, "limit_bytes": limit, "limit": limit_text,
               "target_tokens": args.target_tokens, "shape": shape.as_dict(), "engine": engine.name,
               "settings": result.settings, "simulations": result.simulations, "cpu_seconds": result.cpu_seconds,
               "ranked": [{**o.as_json(), "apply": apply_settings(engine, o.setting, utilization if i == 0 else None)}
                          for i, o in enumerate(result.ranked)],
               "process": result.process.as_json(),
               "pruned": len(result.pruned), "left_out": list(result.left_out), "lines": lines,
               "utilization": utilization, "notes": [*state.notes, *result.notes], "cap": cap,
               "history_ops": None if history is None else len(history.ops),
               "hook_gauge": None if hook is None else hook["max_fit_tokens"]}
        if allocator is not None:
            doc["verify"] = {"allocator": allocator, "settings": [v.as_json() for v in verified]}
        write_stdout(json.dumps(doc, indent=1))
    else:
        text = format_result(result, engine, where, limit_text, utilization, lines)
        if hook is not None:
            text += (f"\nthe hook's gauge ({catalogue.FORECAST_MAX_PREFILL_TOKENS.series}) at its last fit: "
                     f"{hook['max_fit_tokens']:,} tokens; workload {hook['shape'].layers} layers, chunk "
                     f"{hook['shape'].chunk:,}, budget {hook['shape'].logits_budget_mib:g} MiB, "
                     f"{hook['mode']}, rows x {hook['pattern'].row_scale:g}; settings "
                     f"{hook['alloc_conf'] or 'defaults'!r}")
        if allocator is not None:
            text += "\n" + format_verified(verified, allocator)
        write_stdout(text)
    return 1 if verified and not all(v.agrees for v in verified) else 0


__all__ = ["configure", "format_result", "run", "write_plot"]
