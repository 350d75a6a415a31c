"""`memtel replay`: the sparse indexer's logits allocations alone, on CUDA or on the simulator.

A prefill of `--tokens` in `--chunk` steps; at every step and layer the planner's launches each
allocate float32 logits `[rows, width]` through `harness.indexer.launch:indexer_logits_launch`. By
default the previous launch's logits stay alive while the next one allocates, as in a pipeline.
Arms: `stock` and `fixed` widths, each optionally with its own allocator settings and a private
memory pool for the logits. Every arm starts from an empty allocator: on CUDA each arm runs in
its own process, because PyTorch reads `PYTORCH_CUDA_ALLOC_CONF` once per process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness.indexer import launch as indexer
from harness.indexer.planner import MIB, MODES, ChunkStep, PlannerConfig, plan_prefill

Row = list[int]


@dataclass(frozen=True)
class ArmSpec:
    """`MODE[+mempool][@ALLOC_CONF]`, e.g. `stock`, `fixed+mempool`, `stock@expandable_segments:True`."""

    mode: str
    alloc_conf: str = ""
    mempool: bool = False

    @property
    def name(self) -> str:
        return self.mode + ("+mempool" if self.mempool else "") + (f"@{self.alloc_conf}" if self.alloc_conf else "")

    @classmethod
    def parse(cls, text: str, base_conf: str = "") -> ArmSpec:
        head, _, conf = text.partition("@")
        mode, _, extra = head.partition("+")
        if mode not in MODES:
            raise ValueError(f"arm {text!r}: mode must be one of {', '.join(MODES)} (form MODE[+mempool][@ALLOC_CONF])")
        if extra not in ("", "mempool"):
            raise ValueError(f"arm {text!r}: unknown modifier {extra!r}; the only one is +mempool")
        merged = ",".join(part for part in (base_conf.strip(), conf.strip()) if part)
        from harness.allocsim.config import parse_alloc_conf

        parse_alloc_conf(merged)  # fail early, naming the bad setting
        return cls(mode, merged, extra == "mempool")


@dataclass(frozen=True)
class ReplayParams:
    tokens: int = 98_304
    chunk: int = 8192
    layers: int = 45
    compress_ratio: int = 4
    max_model_len: int = 204_800
    fixed_width: int | None = None
    budget_mb: int = 512
    keep_previous: bool = True
    transient_mb: float = 0.0
    topk: int = 0

    def planner(self, mode: str) -> PlannerConfig:
        return PlannerConfig(
            mode=mode,
            chunk=self.chunk,
            compress_ratio=self.compress_ratio,
            max_model_len=self.max_model_len,
            max_logits_bytes=self.budget_mb * MIB,
            fixed_width=self.fixed_width,
        )


@dataclass
class ArmTrace:
    """Everything one arm did: the ops in truth-file form, the counters after each, and labels."""

    ops: list[list[Any]] = field(default_factory=list)
    after: list[Row] = field(default_factory=list)
    # per launch: (op index of its logits malloc, step index, layer, launch index)
    launches: list[tuple[int, int, int, int]] = field(default_factory=list)
    step_end: list[int] = field(default_factory=list)  # op index of each chunk step's last op


# ---- backends ------------------------------------------------------------------------------


class SimBackend:
    def __init__(self, arm: ArmSpec, capacity_bytes: int | None, row_scale: float = 1.0) -> None:
        from harness.allocsim import CachingAllocatorSim, DriverAddressSpace

        self.row_scale = row_scale  # the lab server's --scale, for predictions of its ranks

        driver = DriverAddressSpace()  # one process: both pools' segments come from one driver
        self.main = CachingAllocatorSim(arm.alloc_conf, capacity_bytes=capacity_bytes, address_space=driver)
        # A private pool is a second set of block pools: model it as a second allocator.
        self.logits = (
            CachingAllocatorSim(arm.alloc_conf, capacity_bytes=capacity_bytes, address_space=driver)
            if arm.mempool
            else self.main
        )

    def launch(self, rows: int, width: int, kv_len: int) -> Any:
        rows = indexer.scaled_rows(rows, self.row_scale)
        return (self.logits, indexer.indexer_logits_launch(self.logits, rows, width, kv_len))

    def alloc(self, nbytes: int) -> Any:
        return (self.main, self.main.malloc(nbytes))

    def release(self, token: Any) -> None:
        sim, handle = token
        sim.free(handle)

    def counters(self) -> Row:
        a = self.main
        if self.logits is a:
            return [a.reserved_bytes, a.allocated_bytes, a.num_device_alloc, a.num_device_free]
        b = self.logits
        return [
            a.reserved_bytes + b.reserved_bytes,
            a.allocated_bytes + b.allocated_bytes,
            a.num_device_alloc + b.num_device_alloc,
            a.num_device_free + b.num_device_free,
        ]


class _CudaBackend:
    def __init__(self, arm: ArmSpec, device: str) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        torch.cuda.init()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.pool = torch.cuda.MemPool() if arm.mempool else None
        self.base = self._raw()

    def _raw(self) -> Row:
        s = self.torch.cuda.memory_stats(self.device)
        return [
            s.get("reserved_bytes.all.current", 0),
            s.get("allocated_bytes.all.current", 0),
            s.get("num_device_alloc", 0),
            s.get("num_device_free", 0),
        ]

    def launch(self, rows: int, width: int, kv_len: int) -> Any:
        if self.pool is None:
            return indexer.indexer_logits_launch(self.device, rows, width, kv_len)
        with self.torch.cuda.use_mem_pool(self.pool):
            return indexer.indexer_logits_launch(self.device, rows, width, kv_len)

    def alloc(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.device)

    def release(self, token: Any) -> None:
        del token  # the caller held the only other reference; dropping it frees the block

    def counters(self) -> Row:
        raw = self._raw()
        return [raw[i] - self.base[i] for i in range(4)]


# ---- the pattern ---------------------------------------------------------------------------


def run_arm(params: ReplayParams, arm: ArmSpec, backend: Any) -> tuple[ArmTrace, list[ChunkStep]]:
    """Replay the prefill's logits launches for one arm on `backend`, recording after every op."""
    trace = ArmTrace()
    plan = plan_prefill(params.tokens, params.planner(arm.mode))
    live: dict[int, Any] = {}
    next_id = 0
    previous: int | None = None
    transient_bytes = int(params.transient_mb * MIB)

    def record(op: list[Any]) -> None:
        trace.ops.append(op)
        trace.after.append(backend.counters())

    def alloc(nbytes: int, logits: tuple[int, int, int] | None = None) -> int:
        nonlocal next_id
        ident = next_id
        next_id += 1
        live[ident] = backend.launch(*logits) if logits else backend.alloc(nbytes)
        record(["malloc", ident, nbytes])
        return ident

    def free(ident: int) -> None:
        backend.release(live.pop(ident))
        record(["free", ident])

    for step, launches in plan:
        for layer in range(params.layers):
            for index, launch in enumerate(launches):
                trace.launches.append((len(trace.ops), step.index, layer, index))
                logits = alloc(launch.nbytes, (launch.rows, launch.width, launch.kv_len))
                extras = []
                if params.topk:
                    extras.append(alloc(launch.rows * params.topk * 4))  # top-k values, float32
                    extras.append(alloc(launch.rows * params.topk * 8))  # top-k indices, int64
                if transient_bytes:
                    extras.append(alloc(transient_bytes))
                for ident in reversed(extras):
                    free(ident)
                if params.keep_previous:
                    if previous is not None:
                        free(previous)
                    previous = logits
                else:
                    free(logits)
        trace.step_end.append(len(trace.ops) - 1)
    if previous is not None:
        free(previous)
        trace.step_end[-1] = len(trace.ops) - 1
    return trace, [step for step, _ in plan]


def summarize(params: ReplayParams, arm: ArmSpec, trace: ArmTrace, steps: list[ChunkStep]) -> dict[str, Any]:
    """The isolation figures of one arm from its trace (the same code for CUDA and simulator)."""
    rows = trace.after
    end = rows[-1] if rows else [0, 0, 0, 0]
    step_rows = []
    before = [0, 0, 0, 0]
    for step, last in zip(steps, trace.step_end):
        now = rows[last]
        widths = sorted({w for w in _widths(params, arm, step)})
        step_rows.append(
            {
                "step": step.index,
                "tokens": step.tokens_so_far,
                "kv_len": step.kv_len,
                "width": widths[0] if len(widths) == 1 else widths,
                "launches_per_layer": len(_launches(params, arm, step)),
                "reserved_bytes": now[0],
                "growth_bytes": now[0] - before[0],
                "device_allocs": now[2] - before[2],
            }
        )
        before = now
    new_segments = []
    labels = {op: (s, layer, i) for op, s, layer, i in trace.launches}
    current = (0, 0, 0)
    previous_row = [0, 0, 0, 0]
    for op_index, row in enumerate(rows):
        current = labels.get(op_index, current)
        if row[2] > previous_row[2]:
            step_index, layer, launch = current
            new_segments.append(
                {
                    "op": op_index,
                    "step": step_index,
                    "tokens": steps[step_index].tokens_so_far,
                    "layer": layer,
                    "launch": launch,
                    "bytes": row[0] - previous_row[0],
                    "device_allocs": row[2] - previous_row[2],
                }
            )
        previous_row = row
    grew = [s["step"] for s in step_rows if s["growth_bytes"] > 0]
    return {
        "arm": arm.name,
        "mode": arm.mode,
        "alloc_conf": arm.alloc_conf,
        "mempool": arm.mempool,
        "launches": len(trace.launches),
        "ops": len(trace.ops),
        "reserved_growth_bytes": end[0],
        "peak_reserved_bytes": max((r[0] for r in rows), default=0),
        "allocated_end_bytes": end[1],
        "device_allocs": end[2],
        "device_frees": end[3],
        "steps_with_growth": grew,
        "flat_after_step": (max(grew) if grew else None),
        "chunk_steps": step_rows,
        "new_segments": new_segments,
    }


def _launches(params: ReplayParams, arm: ArmSpec, step: ChunkStep):
    from harness.indexer.planner import split_rows

    return split_rows(step.rows, step.kv_len, params.planner(arm.mode))


def _widths(params: ReplayParams, arm: ArmSpec, step: ChunkStep) -> list[int]:
    return [launch.width for launch in _launches(params, arm, step)]


# ---- running arms --------------------------------------------------------------------------


def _trace_dict(trace: ArmTrace) -> dict[str, Any]:
    return asdict(trace)


def run_sim_arm(params: ReplayParams, arm: ArmSpec, capacity_bytes: int | None = None) -> dict[str, Any]:
    trace, steps = run_arm(params, arm, SimBackend(arm, capacity_bytes))
    return {"summary": summarize(params, arm, trace, steps), "trace": _trace_dict(trace)}


def run_cuda_arm(params: ReplayParams, arm: ArmSpec, device: str = "cuda") -> dict[str, Any]:
    """Run one arm in a fresh process with the arm's `PYTORCH_CUDA_ALLOC_CONF`."""
    env = dict(os.environ)
    env["PYTORCH_CUDA_ALLOC_CONF"] = arm.alloc_conf
    env.pop("PYTORCH_ALLOC_CONF", None)
    request = json.dumps({"params": asdict(params), "arm": asdict(arm), "device": device})
    done = subprocess.run(
        [sys.executable, "-m", "harness.indexer.replay", "--cuda-worker"],
        input=request,
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"cuda arm {arm.name} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    result = json.loads(done.stdout)
    trace = ArmTrace(**{k: [tuple(x) if k == "launches" else x for x in v] for k, v in result["trace"].items()})
    steps = [step for step, _ in plan_prefill(params.tokens, params.planner(arm.mode))]
    return {"summary": summarize(params, arm, trace, steps), "trace": result["trace"], "device": result["device"], "torch": result["torch"]}


def _cuda_worker() -> int:
    request = json.loads(sys.stdin.read())
    params = ReplayParams(**request["params"])
    arm = ArmSpec(**request["arm"])
    backend = _CudaBackend(arm, request["device"])
    trace, _ = run_arm(params, arm, backend)
    torch = backend.torch
    props = torch.cuda.get_device_properties(backend.device)
    json.dump(
        {"trace": _trace_dict(trace), "device": f"{props.name} ({props.total_memory} bytes)", "torch": torch.__version__},
        sys.stdout,
    )
    return 0


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


# ---- output --------------------------------------------------------------------------------


def _mib(n: int) -> str:
    return f"{n / MIB:+,.0f} MiB" if n else "0 MiB"


def format_table(result: dict[str, Any]) -> str:
    p = result["params"]
    lines = [
        f"allocator: {result['allocator']} ({result['allocator_reason']})",
        f"prefill {p['tokens']:,} tokens in {p['chunk']:,}-token chunks x {p['layers']} layers, ratio {p['compress_ratio']}, "
        f"budget {p['budget_mb']} MiB, fixed width {result['fixed_width']:,}, "
        f"previous logits {'kept alive' if p['keep_previous'] else 'freed first'}"
        + (f", top-k {p['topk']}" if p["topk"] else "")
        + (f", transient {p['transient_mb']} MiB" if p["transient_mb"] else ""),
        "",
        f"{'arm':<34} {'reserved growth':>16} {'cudaMallocs':>11} {'peak reserved':>14}  growth per chunk step (MiB)",
    ]
    for arm in result["arms"].values():
        s = arm["summary"]
        growth = " ".join(f"{c['growth_bytes'] / MIB:.0f}" for c in s["chunk_steps"])
        lines.append(
            f"{s['arm']:<34} {_mib(s['reserved_growth_bytes']):>16} {s['device_allocs']:>11} "
            f"{s['peak_reserved_bytes'] / MIB:>10,.0f} MiB  {growth}"
        )
    lines.append("")
    lines.append("where the new segments appeared (chunk step @ tokens: cudaMallocs, MiB):")
    for arm in result["arms"].values():
        s = arm["summary"]
        by_step: dict[int, list[int]] = {}
        for seg in s["new_segments"]:
            entry = by_step.setdefault(seg["step"], [0, 0])
            entry[0] += seg["device_allocs"]
            entry[1] += seg["bytes"]
        where = ", ".join(
            f"{step}@{s['chunk_steps'][step]['tokens']:,}: {n}, {b / MIB:+,.0f}" for step, (n, b) in sorted(by_step.items())
        )
        flat = s["flat_after_step"]
        verdict = "no growth" if flat is None else f"last growth at step {flat}"
        lines.append(f"  {s['arm']}: {where or 'none'} ({verdict})")
    return "\n".join(lines)


def write_plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for arm in result["arms"].values():
        steps = arm["summary"]["chunk_steps"]
        xs = [0] + [s["tokens"] for s in steps]
        ys = [0] + [s["reserved_bytes"] / MIB for s in steps]
        ax.step(xs, ys, where="post", marker="o", markersize=3, label=arm["summary"]["arm"])
    ax.set_xlabel("prefill tokens")
    ax.set_ylabel("reserved (MiB, relative to start)")
    ax.set_title(f"indexer logits replay on {result['allocator']}: reserved bytes vs tokens")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_records(result: dict[str, Any], directory: Path) -> list[Path]:
    """Each arm's ops and counters in the allocator-truth format (one file per arm and config)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, arm in enumerate(result["arms"].values()):
        s = arm["summary"]
        doc = {
            "config": s["alloc_conf"],
            "torch": arm.get("torch", "n/a (simulator)"),
            "device": arm.get("device", "caching-allocator simulator"),
            "cases": {f"replay_{s['mode']}": {"ops": arm["trace"]["ops"], "after": arm["trace"]["after"]}},
        }
        path = directory / f"replay-{index}-{s['mode']}{'-mempool' if s['mempool'] else ''}.json"
        path.write_text(json.dumps(doc, separators=(",", ":")))
        paths.append(path)
    return paths


# ---- command line --------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=98_304, help="prefill length in tokens (default 98304)")
    parser.add_argument("--chunk", type=int, default=8192, help="chunked-prefill step in tokens (default 8192)")
    parser.add_argument("--layers", type=int, default=45, help="indexer layers per chunk step (default 45)")
    parser.add_argument("--compress-ratio", type=int, default=4, help="kv compression ratio (default 4)")
    parser.add_argument("--max-model-len", type=int, default=204_800, help="sets the fixed width: ceil(len / ratio)")
    parser.add_argument("--fixed-width", type=int, default=None, help="fixed arm width (overrides --max-model-len)")
    parser.add_argument("--budget-mb", type=int, default=512, help="max logits bytes per launch in MiB (default 512)")
    parser.add_argument(
        "--arm",
        action="append",
        default=None,
        metavar="SPEC",
        help="MODE[+mempool][@ALLOC_CONF], repeatable; default: stock and fixed "
        "(e.g. 'stock@expandable_segments:True', 'fixed+mempool', 'stock@max_split_size_mb:256')",
    )
    parser.add_argument("--alloc-conf", default="", help="PYTORCH_CUDA_ALLOC_CONF applied to every arm")
    parser.add_argument(
        "--keep-previous",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the previous launch's logits alive while the next allocates (default: yes)",
    )
    parser.add_argument("--transient-mb", type=float, default=0.0, help="interleave a transient allocation of this size per launch")
    parser.add_argument("--topk", type=int, default=0, help="allocate top-k outputs (values f32 + indices i64) per launch")
    parser.add_argument("--allocator", choices=("cuda", "sim"), default=None, help="default: cuda if available, else sim")
    parser.add_argument("--device", default="cuda", help="CUDA device for --allocator cuda (default cuda)")
    parser.add_argument("--capacity-gb", type=float, default=None, help="simulated device capacity (sim only)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
    parser.add_argument("--out", type=Path, default=None, help="directory for replay.json and the PNG plot")
    parser.add_argument("--plot", type=Path, default=None, help="PNG path (default OUT/replay-reserved.png when --out is given)")
    parser.add_argument("--record", type=Path, default=None, help="write each arm's ops + counters in the truth format here")
    parser.add_argument("--cuda-worker", action="store_true", help=argparse.SUPPRESS)


def replay(params: ReplayParams, arms: list[ArmSpec], allocator: str, *, device: str = "cuda", capacity_bytes: int | None = None, reason: str = "") -> dict[str, Any]:
    result: dict[str, Any] = {
        "allocator": allocator,
        "allocator_reason": reason or "chosen",
        "params": asdict(params),
        "fixed_width": params.planner("fixed").padded_width,
        "arms": {},
    }
    for arm in arms:
        if arm.name in result["arms"]:
            raise ValueError(f"arm {arm.name!r} given twice")
        if allocator == "cuda":
            result["arms"][arm.name] = run_cuda_arm(params, arm, device)
        else:
            result["arms"][arm.name] = run_sim_arm(params, arm, capacity_bytes)
    return result


def run(args: argparse.Namespace) -> int:
    if args.cuda_worker:
        return _cuda_worker()
    try:
        params = ReplayParams(
            tokens=args.tokens,
            chunk=args.chunk,
            layers=args.layers,
            compress_ratio=args.compress_ratio,
            max_model_len=args.max_model_len,
            fixed_width=args.fixed_width,
            budget_mb=args.budget_mb,
            keep_previous=args.keep_previous,
            transient_mb=args.transient_mb,
            topk=args.topk,
        )
        for name in ("tokens", "chunk", "layers"):
            if getattr(params, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(params, name)}")
        if params.transient_mb < 0 or params.topk < 0:
            raise ValueError("--transient-mb and --topk must be >= 0")
        params.planner("fixed")  # validates the planner settings
        arms = [ArmSpec.parse(spec, args.alloc_conf) for spec in (args.arm or ["stock", "fixed"])]
    except ValueError as exc:
        print(f"memtel replay: {exc}", file=sys.stderr)
        return 2
    if args.allocator is None:
        allocator = "cuda" if cuda_available() else "sim"
        reason = "default: CUDA is available" if allocator == "cuda" else "default: no CUDA device here, using the simulator"
    else:
        allocator, reason = args.allocator, f"--allocator {args.allocator}"
        if allocator == "cuda" and not cuda_available():
            print("memtel replay: --allocator cuda needs torch with a CUDA device; use --allocator sim", file=sys.stderr)
            return 2
    capacity = int(args.capacity_gb * 1024**3) if args.capacity_gb else None
    try:
        result = replay(params, arms, allocator, device=args.device, capacity_bytes=capacity, reason=reason)
    except (RuntimeError, MemoryError) as exc:
        print(f"memtel replay: {exc}", file=sys.stderr)
        return 1
    if args.record:
        write_records(result, args.record)
    summary = {k: v for k, v in result.items() if k != "arms"}
    summary["arms"] = {name: arm["summary"] for name, arm in result["arms"].items()}
    plot_path = args.plot or (args.out / "replay-reserved.png" if args.out else None)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "replay.json").write_text(json.dumps(summary, indent=1))
    if plot_path:
        write_plot(result, plot_path)
        summary["plot"] = str(plot_path)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(format_table(result))
        if plot_path:
            print(f"\nplot: {plot_path}")
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="memtel replay")
    configure(_parser)
    sys.exit(run(_parser.parse_args()))
