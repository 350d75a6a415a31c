"""The replay of `memtel replay` (its command line is replay_cli.py): the sparse indexer's logits allocations
alone, on CUDA or on the simulator.

A prefill of `--tokens` runs through the one launch loop (`telemetry.model.indexer.prefill.run_prefill`) once
per arm. An arm (`MODE[+mempool][@ALLOC_CONF]`) is a width mode, optionally with its own allocator
settings and a private memory pool for the logits. Every arm starts from an empty allocator: on CUDA
each arm runs in its own process, because PyTorch reads `PYTORCH_CUDA_ALLOC_CONF` once per process.
The trace of an arm is every op in the allocator-truth format with the counters after it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from telemetry import limits
from telemetry.allocator_counters import AllocatorCounters
from telemetry.errors import ConfigError, RunError
from telemetry.model.indexer.backends import CudaBackend, LaunchBackend, SimBackend
from telemetry.model.indexer.planner import MODES, ChunkStep, Launch, Mode, check_mode, launch_count, plan_prefill
from telemetry.model.indexer.prefill import LaunchPattern, Op, PrefillObserver, run_prefill
from telemetry.model.indexer.shape import MIB, REFERENCE_SHAPE, IndexerShape

DEFAULT_TOKENS = 98_304  # the prefill of the H200 truth (tests/fixtures/allocator-truth/replay98k-*)


@dataclass(frozen=True)
class ArmSpec:
    """One arm of a replay: `MODE[+mempool][@ALLOC_CONF]`.

    E.g. `stock`, `fixed+mempool`, `stock@expandable_segments:True`: a width mode, optionally with its own
    allocator settings and a private memory pool for the logits.
    """

    mode: Mode
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
            raise ConfigError(f"arm {text!r}: mode must be one of {', '.join(MODES)} "
                              "(form MODE[+mempool][@ALLOC_CONF])")
        if extra not in ("", "mempool"):
            raise ConfigError(f"arm {text!r}: unknown modifier {extra!r}; the only one is +mempool")
        merged = ",".join(part for part in (base_conf.strip(), conf.strip()) if part)
        from telemetry.model.allocsim.config import parse_alloc_conf

        try:
            parse_alloc_conf(merged)  # fail early, naming the bad setting
        except ValueError as exc:
            raise ConfigError(f"arm {text!r}: {exc}") from None
        return cls(check_mode(mode), merged, extra == "mempool")


@dataclass(frozen=True)
class ReplayParams:
    """One replayed prefill: the workload's shape, its length, and how the loop makes its launches."""

    shape: IndexerShape = REFERENCE_SHAPE
    tokens: int = DEFAULT_TOKENS
    pattern: LaunchPattern = field(default_factory=LaunchPattern)

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or not (
                1 <= self.tokens <= limits.MAX_PREFILL_TOKENS):
            raise ConfigError(f"replay tokens must be an integer from 1 to {limits.MAX_PREFILL_TOKENS:,}, "
                              f"got {self.tokens!r}")
        if self.pattern.row_scale != 1.0:
            raise ConfigError("a replay runs full-size launches (row_scale 1)")
        # Each launch is a few ops with counters kept in memory: bound the work before any of it is done.
        steps = -(-self.tokens // self.shape.chunk)
        per_layer = steps if steps * self.shape.layers > limits.MAX_REPLAY_LAUNCHES else max(
            launch_count(self.tokens, self.shape, mode, limit=limits.MAX_REPLAY_LAUNCHES // self.shape.layers)
            for mode in MODES)
        if per_layer * self.shape.layers > limits.MAX_REPLAY_LAUNCHES:
            raise ConfigError(
                f"a replay of {self.tokens:,} tokens in {self.shape.chunk:,}-token chunks over {self.shape.layers:,} "
                f"layers makes more than {limits.MAX_REPLAY_LAUNCHES:,} logits launches per arm (the limit); use "
                "fewer layers or tokens, a larger chunk or a larger --budget-mb")

    def to_json(self) -> dict[str, Any]:
        return {"shape": self.shape.as_dict(), "tokens": self.tokens, "keep_previous": self.pattern.keep_previous,
                "transient_bytes": self.pattern.transient_bytes}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReplayParams:
        return cls(IndexerShape(**data["shape"]), data["tokens"],
                   LaunchPattern(keep_previous=data["keep_previous"], transient_bytes=data["transient_bytes"]))

    def plan(self, mode: Mode) -> list[tuple[ChunkStep, list[Launch]]]:
        return plan_prefill(self.tokens, self.shape, mode)


# ---- the trace: every op and the counters after it ---------------------------------------------


@dataclass(frozen=True)
class LaunchLabel:
    """Where a launch's logits malloc sits in the trace, and which launch it is."""

    op: int
    step: int
    layer: int
    launch: int


@dataclass
class OpTrace:
    """Everything one arm did: the ops in truth-file form, the counters after each (relative to the start)."""

    ops: list[Op] = field(default_factory=list)
    after: list[AllocatorCounters] = field(default_factory=list)
    launches: list[LaunchLabel] = field(default_factory=list)
    step_end: list[int] = field(default_factory=list)  # op index of each chunk step's last op

    def to_json(self) -> dict[str, Any]:
        return {"ops": self.ops, "after": [list(row) for row in self.after],
                "launches": [asdict(label) for label in self.launches], "step_end": self.step_end}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OpTrace:
        return cls(list(data["ops"]), [AllocatorCounters(*row) for row in data["after"]],
                   [LaunchLabel(**label) for label in data["launches"]], list(data["step_end"]))

    def truth_rows(self) -> list[list[int]]:
        """`after` as rows of the allocator-truth format."""
        return [row.row() for row in self.after]


class TraceRecorder(PrefillObserver):
    """Fills an `OpTrace` from the launch loop, reading the backend's counters after every op."""

    def __init__(self, backend: LaunchBackend, trace: OpTrace | None = None) -> None:
        self.backend = backend
        self.base = backend.counters()
        self.trace = trace if trace is not None else OpTrace()

    def launch_started(self, step: ChunkStep, layer: int, index: int) -> None:
        self.trace.launches.append(LaunchLabel(len(self.trace.ops), step.index, layer, index))

    def op_done(self, op: Op) -> None:
        self.trace.ops.append(op)
        self.trace.after.append(self.backend.counters().minus(self.base))

    def step_ended(self, step: ChunkStep, launches: list[Launch]) -> None:
        self.trace.step_end.append(len(self.trace.ops) - 1)


def trace_prefill(params: ReplayParams, mode: Mode, backend: LaunchBackend) -> OpTrace:
    """Replay the prefill's launches in `mode` on `backend`, recording after every op."""
    recorder = TraceRecorder(backend)
    run_prefill(backend, params.shape, mode, params.tokens, pattern=params.pattern, observer=recorder)
    return recorder.trace


def arm_ops(params: ReplayParams, arm: ArmSpec) -> list[Op]:
    """The op sequence of one arm (the same on every allocator), from a simulator run."""
    return trace_prefill(params, arm.mode, SimBackend(arm.alloc_conf, mempool=arm.mempool)).ops


# ---- what an arm's trace says --------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkStepGrowth:
    step: int
    tokens: int
    kv_len: int
    width: int | list[int]
    launches_per_layer: int
    reserved_bytes: int
    growth_bytes: int
    num_device_alloc: int  # during this chunk step


@dataclass(frozen=True)
class NewSegment:
    """Device memory mapped by one op: where in the prefill it happened."""

    op: int
    step: int
    tokens: int
    layer: int
    launch: int
    bytes: int
    num_device_alloc: int


@dataclass(frozen=True)
class ArmSummary:
    """The isolation figures of one arm (the same code for CUDA and the simulator)."""

    arm: str
    mode: str
    alloc_conf: str
    mempool: bool
    launches: int
    ops: int
    reserved_growth_bytes: int
    peak_reserved_bytes: int
    allocated_end_bytes: int
    num_device_alloc: int
    num_device_free: int
    steps_with_growth: list[int]
    flat_after_step: int | None
    chunk_steps: list[ChunkStepGrowth]
    new_segments: list[NewSegment]


def summarize(params: ReplayParams, arm: ArmSpec, trace: OpTrace) -> ArmSummary:
    plan = params.plan(arm.mode)
    rows = trace.after
    zero = AllocatorCounters(0, 0, 0, 0)
    end = rows[-1] if rows else zero
    step_rows = []
    before = zero
    for (step, launches), last in zip(plan, trace.step_end, strict=True):
        now = rows[last]
        widths = sorted({launch.width for launch in launches})
        step_rows.append(ChunkStepGrowth(
            step=step.index, tokens=step.tokens_so_far, kv_len=step.kv_len,
            width=widths[0] if len(widths) == 1 else widths, launches_per_layer=len(launches),
            reserved_bytes=now.reserved_bytes, growth_bytes=now.reserved_bytes - before.reserved_bytes,
            num_device_alloc=now.num_device_alloc - before.num_device_alloc))
        before = now
    new_segments = []
    labels = {label.op: label for label in trace.launches}
    current = LaunchLabel(0, 0, 0, 0)
    previous = zero
    for op_index, row in enumerate(rows):
        current = labels.get(op_index, current)
        if row.num_device_alloc > previous.num_device_alloc:
            new_segments.append(NewSegment(
                op=op_index, step=current.step, tokens=plan[current.step][0].tokens_so_far, layer=current.layer,
                launch=current.launch, bytes=row.reserved_bytes - previous.reserved_bytes,
                num_device_alloc=row.num_device_alloc - previous.num_device_alloc))
        previous = row
    grew = [s.step for s in step_rows if s.growth_bytes > 0]
    return ArmSummary(
        arm=arm.name, mode=arm.mode, alloc_conf=arm.alloc_conf, mempool=arm.mempool, launches=len(trace.launches),
        ops=len(trace.ops), reserved_growth_bytes=end.reserved_bytes,
        peak_reserved_bytes=max((r.reserved_bytes for r in rows), default=0),
        allocated_end_bytes=end.allocated_bytes, num_device_alloc=end.num_device_alloc,
        num_device_free=end.num_device_free, steps_with_growth=grew, flat_after_step=max(grew) if grew else None,
        chunk_steps=step_rows, new_segments=new_segments)


# ---- running arms --------------------------------------------------------------------------


@dataclass
class ArmReplay:
    arm: ArmSpec
    summary: ArmSummary
    trace: OpTrace
    device: str = "caching-allocator simulator"
    torch: str = "n/a (simulator)"


@dataclass
class ReplayResult:
    allocator: str
    allocator_reason: str
    params: ReplayParams
    arms: dict[str, ArmReplay] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """replay.json and `--json`: the settings and every arm's summary (not the traces)."""
        return {"allocator": self.allocator, "allocator_reason": self.allocator_reason,
                "params": self.params.to_json(), "padded_width": self.params.shape.padded_width,
                "arms": {name: asdict(arm.summary) for name, arm in self.arms.items()}}


def run_sim_arm(params: ReplayParams, arm: ArmSpec, capacity_bytes: int | None = None) -> ArmReplay:
    trace = trace_prefill(params, arm.mode, SimBackend(arm.alloc_conf, mempool=arm.mempool,
                                                       capacity_bytes=capacity_bytes))
    return ArmReplay(arm, summarize(params, arm, trace), trace)


def run_cuda_arm(params: ReplayParams, arm: ArmSpec, device: str = "cuda") -> ArmReplay:
    """Run one arm in a fresh process with the arm's `PYTORCH_CUDA_ALLOC_CONF`."""
    env = dict(os.environ)
    env["PYTORCH_CUDA_ALLOC_CONF"] = arm.alloc_conf
    env.pop("PYTORCH_ALLOC_CONF", None)
    request = json.dumps({"params": params.to_json(), "arm": asdict(arm), "device": device})
    done = subprocess.run([sys.executable, "-m", "telemetry.model.indexer.replay", "--cuda-worker"], input=request,
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RunError(f"cuda arm {arm.name} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    result = json.loads(done.stdout)
    trace = OpTrace.from_json(result["trace"])
    return ArmReplay(arm, summarize(params, arm, trace), trace, result["device"], result["torch"])


def _cuda_worker() -> int:
    request = json.loads(sys.stdin.read())
    params = ReplayParams.from_json(request["params"])
    arm = ArmSpec(**request["arm"])
    backend = CudaBackend(request["device"], mempool=arm.mempool)
    trace = trace_prefill(params, arm.mode, backend)
    info = backend.describe()
    json.dump({"trace": trace.to_json(), "device": f"{info['device_name']} ({info['device_total_bytes']} bytes)",
               "torch": info["torch"]}, sys.stdout)
    return 0


def replay(params: ReplayParams, arms: list[ArmSpec], allocator: str, *, device: str = "cuda",
           capacity_bytes: int | None = None, reason: str = "") -> ReplayResult:
    result = ReplayResult(allocator, reason or "chosen", params)
    for arm in arms:
        if arm.name in result.arms:
            raise ConfigError(f"arm {arm.name!r} given twice")
        if allocator == "cuda":
            result.arms[arm.name] = run_cuda_arm(params, arm, device)
        else:
            result.arms[arm.name] = run_sim_arm(params, arm, capacity_bytes)
    return result


# ---- output --------------------------------------------------------------------------------


def _mib(n: int) -> str:
    return f"{n / MIB:+,.0f} MiB" if n else "0 MiB"


def format_table(result: ReplayResult) -> str:
    p = result.params
    shape = p.shape
    lines = [
        f"allocator: {result.allocator} ({result.allocator_reason})",
        f"prefill {p.tokens:,} tokens in {shape.chunk:,}-token chunks x {shape.layers} layers, ratio "
        f"{shape.compress_ratio}, logits budget {shape.logits_budget_mib:g} MiB, padded width {shape.padded_width:,}, "
        f"previous logits {'kept alive' if p.pattern.keep_previous else 'freed first'}"
        + (f", top-k {shape.topk}" if shape.topk else "")
        + (f", transient {p.pattern.transient_bytes / MIB:g} MiB" if p.pattern.transient_bytes else ""),
        "",
        f"{'arm':<34} {'reserved growth':>16} {'device allocs':>13} {'peak reserved':>14}  growth per chunk step (MiB)",
    ]
    for arm in result.arms.values():
        s = arm.summary
        growth = " ".join(f"{c.growth_bytes / MIB:.0f}" for c in s.chunk_steps)
        lines.append(f"{s.arm:<34} {_mib(s.reserved_growth_bytes):>16} {s.num_device_alloc:>13} "
                     f"{s.peak_reserved_bytes / MIB:>10,.0f} MiB  {growth}")
    lines.append("")
    lines.append("where the new segments appeared (chunk step @ tokens: device allocs, MiB):")
    for arm in result.arms.values():
        s = arm.summary
        by_step: dict[int, list[int]] = {}
        for seg in s.new_segments:
            entry = by_step.setdefault(seg.step, [0, 0])
            entry[0] += seg.num_device_alloc
            entry[1] += seg.bytes
        where = ", ".join(f"{step}@{s.chunk_steps[step].tokens:,}: {n}, {b / MIB:+,.0f}"
                          for step, (n, b) in sorted(by_step.items()))
        verdict = "no growth" if s.flat_after_step is None else f"last growth at step {s.flat_after_step}"
        lines.append(f"  {s.arm}: {where or 'none'} ({verdict})")
    return "\n".join(lines)


def write_plot(result: ReplayResult, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for arm in result.arms.values():
        steps = arm.summary.chunk_steps
        xs = [0] + [s.tokens for s in steps]
        ys = [0] + [s.reserved_bytes / MIB for s in steps]
        ax.step(xs, ys, where="post", marker="o", markersize=3, label=arm.summary.arm)
    ax.set_xlabel("prefill tokens")
    ax.set_ylabel("reserved (MiB, relative to start)")
    ax.set_title(f"indexer logits replay on {result.allocator}: reserved bytes vs tokens")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_records(result: ReplayResult, directory: Path) -> list[Path]:
    """Each arm's ops and counters in the allocator-truth format (one file per arm)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, arm in enumerate(result.arms.values()):
        doc = {"config": arm.arm.alloc_conf, "torch": arm.torch, "device": arm.device,
               "cases": {f"replay_{arm.arm.mode}": {"ops": arm.trace.ops, "after": arm.trace.truth_rows()}}}
        path = directory / f"replay-{index}-{arm.arm.mode}{'-mempool' if arm.arm.mempool else ''}.json"
        path.write_text(json.dumps(doc, separators=(",", ":")))
        paths.append(path)
    return paths


__all__ = ["DEFAULT_TOKENS", "ArmReplay", "ArmSpec", "ArmSummary", "OpTrace", "ReplayParams", "ReplayResult",
           "TraceRecorder", "arm_ops", "format_table", "replay", "summarize", "trace_prefill", "write_plot",
           "write_records"]


if __name__ == "__main__":  # the worker of one CUDA arm, in a fresh process (run_cuda_arm); memtel replay is replay_cli
    if sys.argv[1:] != ["--cuda-worker"]:
        sys.exit("usage: python -m telemetry.model.indexer.replay --cuda-worker (the command is memtel replay)")
    sys.exit(_cuda_worker())
