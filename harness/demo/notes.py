"""The demo's own section of the report: what ran, what the simulator predicts, what was measured.

`memtel ab report` knows nothing about the lab server, so a reader of the demo's report would not know
that the servers were a model of the indexer, what the scale means, or whether the numbers are right.
This section says so and checks the run against a prediction made independently of the lab server: the
launch loop (`telemetry.model.indexer.prefill.run_prefill`, as `memtel replay` runs it) on a fresh simulator, fed
the same prompts in the same order, with the same shape. With the simulator the two must agree exactly.
It also says what the TTFT columns measure here, so that a difference between the arms on this machine
is not taken for the fix's effect.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from harness.ab.config import Step
from harness.ab.report import Report, RunMetrics, Section, Table
from harness.ab.report import markdown as md
from harness.ab.report.hook_calls import CallSeries
from harness.demo.setup import DemoSetup
from harness.labserver.cost_model import CostModel
from telemetry.model.indexer.backends import SimBackend
from telemetry.model.indexer.planner import ChunkStep, Launch, Mode, check_mode, plan_prefill
from telemetry.model.indexer.prefill import LaunchPattern, PrefillObserver, run_prefill
from telemetry.model.indexer.shape import MIB

SUMMARY_FILE = "demo-summary.json"
# In the TTFT plot itself (by "the allocator is the simulator"): a picture is read without the text around it.
TTFT_CAVEAT = {
    True: "memtel demo, simulator: a TTFT gap between the arms here is NOT the fix's effect. No GPU computes; "
          "each rank sleeps a cost model plus Python and host-page work that differs by arm, on a shared machine. "
          "See the report's \"Time to first token\".",
    False: "memtel demo: a TTFT gap between the arms here is NOT the fix's effect on a served model. TTFT is the "
           "ranks' allocations and writes without the indexer's kernels. See the report's \"Time to first token\".",
}
H200_RECORD = "docs/results/h200-demo-cuda.md"


@dataclass(frozen=True)
class StepPrediction:
    label: str
    tokens: int
    reserved_after_bytes: int
    num_device_alloc_after: int
    chunk_step_growth_bytes: list[int]  # reserved growth at each chunk step of this request


class _ChunkEnds(PrefillObserver):
    def __init__(self, backend: SimBackend) -> None:
        self.backend = backend
        self.reserved: list[int] = []

    def step_ended(self, step: ChunkStep, launches: list[Launch]) -> None:
        self.reserved.append(self.backend.counters().reserved_bytes)


def predict(setup: DemoSetup, steps: list[Step], mode: Mode) -> list[StepPrediction]:
    """Reserved bytes and device allocs of one rank after each prompt of the ladder, per the launch loop."""
    # The ranks' allocator settings are PYTORCH_CUDA_ALLOC_CONF, which they inherit.
    backend = SimBackend(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    pattern = LaunchPattern(row_scale=setup.scale)
    out = []
    for step in steps:
        before = backend.counters().reserved_bytes
        ends = _ChunkEnds(backend)
        run_prefill(backend, setup.shape, mode, step.tokens, pattern=pattern, observer=ends)
        growth = [end - prev for end, prev in zip(ends.reserved, [before, *ends.reserved[:-1]], strict=True)]
        counters = backend.counters()
        out.append(StepPrediction(step.label, step.tokens, counters.reserved_bytes, counters.num_device_alloc, growth))
    return out


def modeled_prefill_s(setup: DemoSetup, mode: Mode, tokens: int) -> float:
    """The cost model's time for one cold prefill, as a simulator rank sleeps it (× time-scale)."""
    cost = CostModel(time_scale=setup.time_scale)
    return sum(cost.prefill_step_s(step.rows, sum(launch.computed_elements for launch in launches), len(launches),
                                   setup.shape.layers)
               for step, launches in plan_prefill(tokens, setup.shape, mode))


def measured_chunk_growth(calls: CallSeries, started_at: float, ended_at: float, setup: DemoSetup,
                          mode: Mode, tokens: int) -> list[int] | None:
    """Reserved growth per chunk step of one request on one rank, from the hook's per-call log."""
    per_step = [len(launches) * setup.shape.layers for _, launches in plan_prefill(tokens, setup.shape, mode)]
    first, end = calls.window(started_at, ended_at)
    if end - first != sum(per_step) or end <= first:
        return None
    known = calls.known
    step_ends = first - 1 + np.cumsum(per_step)
    if not bool(known[first:end].all()):
        return None
    level = int(calls.reserved_bytes[first - 1]) if first > 0 and known[first - 1] else 0
    ends = [int(v) for v in calls.reserved_bytes[step_ends]]
    return [end_value - before for end_value, before in zip(ends, [level, *ends[:-1]], strict=True)]


@dataclass(frozen=True)
class StepCheck:
    """One (arm, step): prediction against measurement."""

    label: str
    tokens: int
    predicted_reserved_after_bytes: int
    predicted_num_device_alloc_after: int
    measured_reserved_after_bytes: dict[str, float | None]  # rank name ->
    measured_num_device_alloc_after: dict[str, float | None]
    predicted_chunk_step_growth_bytes: list[int]
    measured_chunk_step_growth_bytes_first_rank: list[int] | None
    modeled_prefill_s: float | None  # sim: the cost model's time for this prefill
    agree: bool


@dataclass
class DemoNotes:
    setup: DemoSetup
    arms: dict[str, list[StepCheck]] = field(default_factory=dict)
    sections: list[Section] = field(default_factory=list)
    report_notes: dict[str, list[str]] = field(default_factory=dict)
    plot_caveats: dict[str, str] = field(default_factory=dict)  # written into the images (plots.write_plots)

    @property
    def prediction_agrees(self) -> bool:
        return all(check.agree for checks in self.arms.values() for check in checks)

    def summary(self) -> dict:
        return {"setup": self.setup.as_dict(), "prediction_agrees": self.prediction_agrees,
                "arms": {arm: {"steps": [asdict(c) for c in checks]} for arm, checks in self.arms.items()}}

    def write_summary(self, run_dir: Path) -> Path:
        path = run_dir / SUMMARY_FILE
        path.write_text(json.dumps(self.summary(), indent=2) + "\n")
        return path

    def console_lines(self) -> list[str]:
        lines = []
        for arm, checks in self.arms.items():
            last = checks[-1] if checks else None
            reserved = [v for v in (last.measured_reserved_after_bytes.values() if last else ()) if v is not None]
            allocs = [v for v in (last.measured_num_device_alloc_after.values() if last else ()) if v is not None]
            if reserved and allocs:
                lines.append(f"{arm}: reserved +{max(reserved) / MIB:,.0f} MiB per rank over the ladder, "
                             f"{int(max(allocs))} device allocs")
        return lines


# --- the section ------------------------------------------------------------------------------------


def _integrated_gpu(metrics: RunMetrics) -> bool:
    """Whether the lab ranks said (in the server's /version, recorded by the harness) their GPU is integrated."""
    for info in metrics.run.servers.values():
        version = info.version if isinstance(info.version, dict) else {}
        lab = version.get("lab")
        for rank in (lab.get("ranks_info") or []) if isinstance(lab, dict) else []:
            if isinstance(rank, dict) and rank.get("integrated"):
                return True
    return False


def _steps_with_growth(growth: list[int] | None) -> str:
    if growth is None:
        return "n/a"
    grew = [i for i, g in enumerate(growth) if g > 0]  # chunk steps count from 0, as in replay and forecast
    if not grew:
        return f"none of {len(growth)}"
    return f"{md.ranges(grew)} of {len(growth)}"


def result_line(metrics: RunMetrics, notes: DemoNotes) -> str:
    """The result first: each arm's reserved growth and device allocations over the run (repeat 0, the busiest
    rank), and whether every step agreed with the prediction; the details follow."""
    parts = []
    for arm in metrics.run.arms:
        growth: dict[str, float] = {}
        allocs: dict[str, float] = {}
        for m in metrics.requests.values():
            if m.arm == arm and m.repeat == 0:
                for rank, r in m.ranks.items():
                    growth[rank] = growth.get(rank, 0) + (r.reserved_growth_bytes or 0)
                    allocs[rank] = allocs.get(rank, 0) + (r.num_device_alloc or 0)
        if growth:
            rank = max(growth, key=lambda name: growth[name])
            parts.append(f"**{arm}** reserved {growth[rank] / MIB:+,.0f} MiB in {allocs[rank]:,.0f} device "
                         f"allocations")
    checks = [c for arm_checks in notes.arms.values() for c in arm_checks]
    agreed = sum(c.agree for c in checks)
    return (f"**Result:** over the run, per rank, {'; '.join(parts) or 'no allocator series were read'}. The "
            f"prediction of `memtel replay` agreed with the ranks on {agreed} of {len(checks)} steps.")


def _intro(setup: DemoSetup, metrics: RunMetrics) -> list[str]:
    shape = setup.shape
    lines = [
        f"Both arms are `memtel lab serve` servers with {setup.ranks} ranks each, started fresh by the harness. "
        f"The lab server reproduces the sparse indexer's prefill allocations behind vLLM's API: every request "
        f"is prefilled in {shape.chunk:,}-token chunks through {shape.layers} layers; at each chunk step and layer "
        f"the indexer planner (logits budget {shape.logits_budget_mib:g} MiB per launch, compress ratio "
        f"{shape.compress_ratio}) decides the float32 logits launches, and each launch goes through "
        f"`telemetry.model.indexer.launch:indexer_logits_launch`, where memtel's hook (preset `lab-indexer`) "
        f"records the "
        f"allocator and the host after every call. **stock** allocates `[rows, N]` with N the kv length so far; "
        f"**fixed** allocates `[rows, {shape.padded_width:,}]` (the padded width, max-model-len / ratio) from the "
        f"first chunk on. Every rank computes the whole logits buffer, as the TP ranks of vLLM's indexer do (its "
        f"query projection is replicated), so every rank shows the same pattern.", ""]
    if setup.allocator == "sim":
        lines.append(
            f"**Allocator: simulator with unified-memory emulation.** The ranks run PyTorch's caching-allocator "
            f"rules on a simulator (`telemetry.model.allocsim`), and every segment it maps is backed by real, touched "
            f"host pages (released when the segment is), so the host's `MemAvailable` below falls as it would on a "
            f"DGX Spark or Grace Hopper box where device memory comes out of host memory. **Scale {setup.scale:g}:** "
            f"every launch has ceil(rows × {setup.scale:g}) rows, so every byte figure here is about {setup.scale:g} "
            f"× that of the full-size workload; widths, token counts, chunk steps and launch counts are full size.")
    elif _integrated_gpu(metrics):
        lines.append(
            "**Allocator: real CUDA on an integrated GPU.** The ranks make real CUDA allocations through "
            "PyTorch's caching allocator and write the computed part of every launch; times are real. This GPU "
            "reports itself as integrated: its memory is the host's, so host MemAvailable moves with device "
            "allocations.")
    else:
        lines.append(
            "**Allocator: real CUDA.** The ranks make real CUDA allocations through PyTorch's caching allocator "
            "and write the computed part of every launch; times are real. **Host memory does not move with "
            "device allocations on a discrete GPU:** device memory is the GPU's own, so the MemAvailable columns "
            "show only the host's background noise here. On a unified-memory machine (DGX Spark / GB10, Grace "
            "Hopper) the same reserved growth would come out of host MemAvailable.")
    return [*lines, ""]


def _ttft_text(setup: DemoSetup) -> str:
    if setup.allocator == "sim":
        return (
            f"**What TTFT measures here.** No GPU computes anything: each simulator rank sleeps the cost model's "
            f"time for the request's work (calibrated to a 54 s cold 100k-token prefill on the user's pair of "
            f"DGX Sparks, × time-scale {setup.time_scale:g}: the \"modeled\" column below). What a rank really "
            f"does shows on top of it, as \"beyond the model\": making every launch in Python (the simulator's "
            f"bookkeeping and the hook's record of each call) and writing the host pages of every new segment "
            f"(the unified-memory emulation), on this machine's {os.cpu_count() or 'few'} cores, shared with the "
            f"harness and anything else running. The arms differ in both (new segments where reserved memory "
            f"grows, more launches where the budget splits rows), so **a TTFT difference between the arms in this "
            f"run is not the fix's effect** and says nothing about TTFT on a GPU; on an H200 with real "
            f"allocations the fixed arm's TTFT was the longer one ({H200_RECORD}).")
    return ("**What TTFT measures here.** Real time: the ranks' CUDA allocations and the writes of the computed "
            "part of every launch, synchronized before the first token. It does not include the indexer's real "
            "kernels, so it is not the TTFT of a served model either.")


def _ttft_table(report: Report, setup: DemoSetup, checks: dict[str, list[StepCheck]]) -> Table:
    rows = []
    for arm, arm_checks in checks.items():
        for check in arm_checks:
            served = report.metrics.spread(arm, check.label, lambda m: m.ttft_server_s)
            beyond = (served.median - check.modeled_prefill_s) if served and check.modeled_prefill_s is not None \
                else None
            rows.append([arm, check.label, md.number(check.modeled_prefill_s, digits=3), md.spread(served, digits=3),
                         md.number(beyond, digits=3, sign=True)])
    return Table(["arm", "step", "modeled prefill (s)", "TTFT server (s)", "beyond the model (s)"], rows)


def build_notes(report: Report, setup: DemoSetup, steps: list[Step]) -> DemoNotes:
    metrics = report.metrics
    run = metrics.run
    notes = DemoNotes(setup)
    check_rows, chunk_rows, host_rows = [], [], []
    for arm in run.arms:
        mode = check_mode(arm)
        checks = notes.arms[arm] = []
        hook = run.hook_calls(arm, 0)
        for prediction in predict(setup, steps, mode):
            m = metrics.requests.get((arm, 0, prediction.label))
            measured = {rank: (m.ranks[rank].reserved_after_bytes if m else None) for rank in run.ranks}
            allocs = {rank: (m.ranks[rank].num_device_alloc_after if m else None) for rank in run.ranks}
            agree = (all(v == prediction.reserved_after_bytes for v in measured.values())
                     and all(a == prediction.num_device_alloc_after for a in allocs.values()))
            first_rank = None
            if m is not None and hook:
                first_rank = measured_chunk_growth(hook[min(hook)], m.started_at - 1e-3, m.ended_at + 1e-3, setup,
                                                   mode, prediction.tokens)
            check = StepCheck(
                label=prediction.label, tokens=prediction.tokens,
                predicted_reserved_after_bytes=prediction.reserved_after_bytes,
                predicted_num_device_alloc_after=prediction.num_device_alloc_after,
                measured_reserved_after_bytes=measured, measured_num_device_alloc_after=allocs,
                predicted_chunk_step_growth_bytes=prediction.chunk_step_growth_bytes,
                measured_chunk_step_growth_bytes_first_rank=first_rank,
                modeled_prefill_s=modeled_prefill_s(setup, mode, prediction.tokens) if setup.allocator == "sim"
                else None, agree=agree)
            checks.append(check)
            check_rows.append([arm, check.label, md.number(check.predicted_reserved_after_bytes, MIB),
                               " / ".join(md.number(v, MIB) for v in measured.values()),
                               str(check.predicted_num_device_alloc_after),
                               " / ".join(md.number(a, digits=0) for a in allocs.values()),
                               "yes" if agree else "**no**"])
            chunk_rows.append([arm, check.label, _steps_with_growth(check.predicted_chunk_step_growth_bytes),
                               _steps_with_growth(first_rank),
                               md.number(sum(check.predicted_chunk_step_growth_bytes), MIB, sign=True),
                               md.number(sum(first_rank) if first_rank else None, MIB, sign=True)])
            if m is not None:
                growth = [r.reserved_growth_bytes for r in m.ranks.values() if r.reserved_growth_bytes is not None]
                host_rows.append([arm, check.label, md.number(sum(growth) if growth else None, MIB, sign=True),
                                  " / ".join(md.number(n.mem_available_delta_bytes, MIB, sign=True)
                                             for n in m.nodes.values()) or "n/a"])
    rank_names = " / ".join(run.ranks)
    lines = [result_line(metrics, notes), "", *_intro(setup, metrics)]
    lines += ["### The ranks against the prediction", "",
              "Predicted: the launch loop that `memtel replay` runs, on a fresh simulator, fed this ladder's prompts "
              "in order with the same shape and scale (the prefix cache never hits: every prompt differs from its "
              f"first words). Measured: each rank's hook exporter after the request ({rank_names}).", "",
              Table(["arm", "step", "predicted reserved (MiB)", f"measured ({rank_names})", "predicted device allocs",
                     "measured", "agree"], check_rows).markdown(),
              "", "### Where the growth happened, chunk step by chunk step", "",
              "Chunk steps of each request during which reserved memory grew (0 = the first chunk, as `memtel "
              "replay` and `memtel forecast` count them), predicted and "
              "as the hook's per-call log of the first rank shows them. The stock arm grows at every chunk step "
              "until its logits reach the budget and are split on rows; the fixed arm grows only in its first chunk "
              "of the run, and not at all in later requests.", "",
              Table(["arm", "step", "predicted growth at chunk steps", "measured (hook log)", "predicted growth (MiB)",
                     "measured (MiB)"], chunk_rows).markdown()]
    first_label = steps[0].label
    per_step_rows = []
    for arm, checks in notes.arms.items():
        first = next(c for c in checks if c.label == first_label).measured_chunk_step_growth_bytes_first_rank
        if first:
            per_step_rows.append([arm] + [f"{g / MIB:+,.0f}" if g else "0" for g in first])
    if per_step_rows:
        width = max(len(r) for r in per_step_rows) - 1
        per_step_rows = [r + [""] * (width + 1 - len(r)) for r in per_step_rows]
        lines += ["", f"Reserved growth of the first rank at each chunk step of the first request ({first_label}), "
                      "MiB, from the hook's per-call log:", "",
                  Table(["arm"] + [f"chunk step {i}" if i == 0 else str(i) for i in range(width)],
                        per_step_rows).markdown()]
    if host_rows:
        lines += ["", "### Host memory against the allocator", "", _host_text(setup), "",
                  Table(["arm", "step", "reserved growth, all ranks (MiB)", "MemAvailable delta per node (MiB)"],
                        host_rows).markdown()]
    lines += ["", "### Time to first token", "", _ttft_text(setup)]
    if setup.allocator == "sim":
        lines += ["", _ttft_table(report, setup, notes.arms).markdown()]
    notes.sections.append(Section("demo", "About this run (memtel demo)", "\n".join(lines), placement="lead",
                                  data=notes.summary()))
    notes.report_notes["ttft"] = ["On this run: see \"Time to first token\" in the demo's section above for what "
                                  "these times measure here; the difference between the arms is not the fix's "
                                  "effect."]
    notes.plot_caveats["ttft"] = TTFT_CAVEAT[setup.allocator == "sim"]
    return notes


def _host_text(setup: DemoSetup) -> str:
    if setup.allocator != "sim":
        return ("On this discrete GPU the ranks' reserved growth is device memory: host MemAvailable moves only with "
                "the background of the machine.")
    from harness.labserver.unified_memory import read_percpu_pagesets

    text = ("Every segment the ranks reserve is backed by host pages, so the host's MemAvailable falls by the ranks' "
            "reserved growth, give or take two things: the background of a shared machine, and the kernel's per-CPU "
            "free page lists. Linux 6.7+ parks just-freed pages there (PCP high auto-tuning) and MemAvailable does "
            "not count them, so the memory a stopped server frees reaches MemAvailable late, and the next server's "
            "first segments can be served from those lists without MemAvailable moving (this is what usually hides "
            "most of the fixed arm's first chunk, which runs right after the stock arm has freed its memory).")
    pcp = read_percpu_pagesets()
    if pcp:
        text += (f" On this machine these lists may hold up to {pcp['high_max_bytes'] / MIB:,.0f} MiB "
                 f"(`high_max` summed over /proc/zoneinfo); they held {pcp['count_bytes'] / MIB:,.0f} MiB when this "
                 "report was written.")
    return text


__all__ = ["DemoNotes", "StepCheck", "StepPrediction", "build_notes", "measured_chunk_growth", "modeled_prefill_s",
           "predict", "result_line"]
