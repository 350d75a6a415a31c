"""The demo's own section of the report: what ran, what the simulator predicts, what was measured.

`memtel ab report` knows nothing about the lab server, so a reader of the demo's report would not know
that the servers were a model of the indexer, what the scale means, or whether the numbers are right.
This section says so and checks the run against a prediction made independently of the lab server:
`memtel replay`'s launch pattern (`harness.indexer.replay.run_arm`) on a fresh simulator, fed the same
prompts in the same order, with the same shapes. With the simulator the two must agree exactly.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIB = 1024 * 1024
MARKER = "<!-- memtel demo notes -->"


@dataclass(frozen=True)
class StepPrediction:
    label: str
    tokens: int
    reserved_after_bytes: int
    device_allocs_after: int
    chunk_step_growth: list[int]  # reserved growth at each chunk step of this request, in bytes


def predict(shape: Any, steps: list[tuple[int, str]], arm: str) -> list[StepPrediction]:
    """Reserved bytes and cudaMallocs of one rank after each prompt of the ladder, per `memtel replay`."""
    from harness.indexer.replay import ArmSpec, ReplayParams, SimBackend, run_arm

    # The ranks' allocator settings are PYTORCH_CUDA_ALLOC_CONF, which they inherit.
    backend = SimBackend(ArmSpec(arm, os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")), None, row_scale=shape.scale)
    out = []
    for tokens, label in steps:
        params = ReplayParams(tokens=tokens, chunk=shape.chunk, layers=shape.layers,
                              compress_ratio=shape.compress_ratio, max_model_len=shape.max_model_len,
                              budget_mb=int(shape.budget_mb))
        before = backend.counters()[0]
        trace, _ = run_arm(params, ArmSpec(arm), backend)
        ends = [trace.after[i][0] for i in trace.step_end]
        growth = [end - prev for end, prev in zip(ends, [before, *ends[:-1]])]
        counters = backend.counters()
        out.append(StepPrediction(label, tokens, counters[0], counters[2], growth))
    return out


def measured_chunk_growth(calls: list[dict], started_at: float, ended_at: float, shape: Any, arm: str,
                          tokens: int) -> list[int] | None:
    """Reserved growth per chunk step of one request on one rank, from the hook's per-call log."""
    from harness.indexer.planner import PlannerConfig, plan_prefill

    planner = PlannerConfig(mode=arm, chunk=shape.chunk, compress_ratio=shape.compress_ratio,
                            max_model_len=shape.max_model_len, max_logits_bytes=int(shape.budget_mb * MIB))
    per_step = [len(launches) * shape.layers for _, launches in plan_prefill(tokens, planner)]
    inside = [i for i, c in enumerate(calls) if started_at <= c.get("ts", 0) <= ended_at]
    if len(inside) != sum(per_step) or not inside or "reserved_bytes" not in calls[inside[0]]:
        return None
    first = inside[0]
    level = calls[first - 1]["reserved_bytes"] if first > 0 and "reserved_bytes" in calls[first - 1] else 0
    growth, position = [], first
    for count in per_step:
        position += count
        end = calls[position - 1]["reserved_bytes"]
        growth.append(end - level)
        level = end
    return growth


def _steps_with_growth(growth: list[int] | None) -> str:
    if growth is None:
        return "n/a"
    grew = [i + 1 for i, g in enumerate(growth) if g > 0]
    if not grew:
        return f"none of {len(growth)}"
    return f"{_ranges(grew)} of {len(growth)}"


def _ranges(numbers: list[int]) -> str:
    parts, start = [], numbers[0]
    for a, b in zip(numbers, numbers[1:] + [None]):
        if b != a + 1:
            parts.append(f"{start}" if start == a else f"{start}–{a}")
            start = b
    return ", ".join(parts)


def _mib(value: float | None, sign: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value / MIB:+,.1f}" if sign else f"{value / MIB:,.1f}"


def build_notes(run_dir: Path, shape: Any, steps: list[tuple[int, str]]) -> tuple[str, dict]:
    from harness.ab.report import load_hook_calls, load_run, request_metrics

    run = load_run(run_dir)
    labels = [label for _, label in steps]
    tokens_of = {label: tokens for tokens, label in steps}
    width = math.ceil(shape.max_model_len / shape.compress_ratio)
    lines = [MARKER, "## About this run (memtel demo)", ""]
    lines.append(
        f"Both arms are `memtel lab serve` servers with {shape.ranks} ranks each, started fresh by the harness. "
        f"The lab server reproduces the sparse indexer's prefill allocations behind vLLM's API: every request "
        f"is prefilled in {shape.chunk:,}-token chunks through {shape.layers} layers; at each chunk step and layer "
        f"the indexer planner (budget {shape.budget_mb:g} MiB per launch, compress ratio {shape.compress_ratio}) "
        f"decides the float32 logits launches, and each launch goes through "
        f"`harness.indexer.launch:indexer_logits_launch`, where memtel's hook (preset `lab-indexer`) records the "
        f"allocator and the host after every call. **stock** allocates `[rows, N]` with N the kv length so far; "
        f"**fixed** allocates `[rows, {width:,}]` (max-model-len / ratio) from the first chunk on. "
        f"Every rank computes the whole logits buffer, as the TP ranks of vLLM's indexer do (its query "
        f"projection is replicated), so every rank shows the same pattern.")
    lines.append("")
    if shape.allocator == "sim":
        lines.append(
            f"**Allocator: simulator with unified-memory emulation.** The ranks run PyTorch's caching-allocator "
            f"rules on a simulator (`harness.allocsim`), and every segment it maps is backed by real, touched "
            f"host pages (released when the segment is), so the host's `MemAvailable` below falls as it would on a "
            f"DGX Spark or Grace Hopper box where cudaMalloc comes out of host memory. **Scale {shape.scale:g}:** "
            f"every launch has ceil(rows × {shape.scale:g}) rows, so every byte figure here is about {shape.scale:g} "
            f"× that of the full-size workload; widths, token counts, chunk steps and launch counts are full size. "
            f"Times are the lab's cost model (calibrated to a 54 s cold 100k-token prefill on the user's pair of "
            f"Sparks) × {shape.time_scale:g}.")
    elif _integrated_gpu(run):
        lines.append(
            "**Allocator: real CUDA on an integrated GPU.** The ranks make real CUDA allocations through "
            "PyTorch's caching allocator and write the computed part of every launch; times are real. This GPU "
            "reports itself as integrated: its memory is the host's, so host MemAvailable moves with cudaMalloc.")
    else:
        lines.append(
            "**Allocator: real CUDA.** The ranks make real CUDA allocations through PyTorch's caching allocator "
            "and write the computed part of every launch; times are real. **Host memory does not move with "
            "cudaMalloc on a discrete GPU:** device memory is the GPU's own, so the MemAvailable columns show only "
            "the host's background noise here. On a unified-memory machine (DGX Spark / GB10, Grace Hopper) the "
            "same reserved growth would come out of host MemAvailable.")
    lines.append("")

    summary: dict = {"shape": {k: getattr(shape, k) for k in ("allocator", "scale", "time_scale", "ranks", "layers",
                                                               "chunk", "max_model_len", "compress_ratio", "budget_mb")},
                     "arms": {}}
    check_rows, chunk_rows, host_rows = [], [], []
    all_agree = True
    for arm in run.arms:
        predicted = predict(shape, steps, arm)
        hook = load_hook_calls(run, arm, 0)
        arm_summary = summary["arms"][arm] = {"steps": []}
        for prediction in predicted:
            m = request_metrics(run, arm, 0, prediction.label)
            measured = [((m or {}).get("ranks", {}).get(rank) or {}).get("reserved_after_bytes") for rank in run.ranks]
            after_allocs = _rank_counter_after(run, arm, prediction.label)
            cells_reserved = [_mib(v) for v in measured]
            agree = all(v == prediction.reserved_after_bytes for v in measured) and all(
                a == prediction.device_allocs_after for a in after_allocs.values())
            all_agree = all_agree and agree
            check_rows.append([arm, prediction.label, _mib(prediction.reserved_after_bytes), " / ".join(cells_reserved),
                               str(prediction.device_allocs_after),
                               " / ".join("n/a" if a is None else str(int(a)) for a in after_allocs.values()),
                               "yes" if agree else "**no**"])
            chunk_measured = []
            for rank_index, calls in sorted(hook.items()):
                if m is None:
                    continue
                growth = measured_chunk_growth(calls, m["started_at"] - 1e-3, m["ended_at"] + 1e-3, shape, arm,
                                               tokens_of[prediction.label])
                chunk_measured.append(growth)
            first = chunk_measured[0] if chunk_measured else None
            chunk_rows.append([arm, prediction.label, _steps_with_growth(prediction.chunk_step_growth),
                               _steps_with_growth(first),
                               _mib(sum(prediction.chunk_step_growth), sign=True),
                               _mib(sum(first) if first else None, sign=True)])
            if m is not None:
                node_deltas = [n.get("mem_available_delta_bytes") for n in m["nodes"].values()]
                rank_growth = [r.get("reserved_growth_bytes") for r in m["ranks"].values()]
                total_growth = sum(g for g in rank_growth if g is not None) if rank_growth else None
                host_rows.append([arm, prediction.label, _mib(total_growth, sign=True),
                                  " / ".join(_mib(d, sign=True) for d in node_deltas) or "n/a"])
            arm_summary["steps"].append({
                "label": prediction.label, "tokens": prediction.tokens,
                "predicted_reserved_after_bytes": prediction.reserved_after_bytes,
                "predicted_device_allocs_after": prediction.device_allocs_after,
                "measured_reserved_after_bytes": dict(zip(run.ranks, measured)),
                "measured_device_allocs_after": after_allocs,
                "predicted_chunk_step_growth_bytes": prediction.chunk_step_growth,
                "measured_chunk_step_growth_bytes_first_rank": first,
                "agree": agree,
            })
    summary["prediction_agrees"] = all_agree
    rank_names = " / ".join(run.ranks)
    lines += ["### The ranks against `memtel replay`'s prediction", "",
              "Predicted: `memtel replay`'s launch pattern on a fresh simulator, fed this ladder's prompts in order "
              "with the same shapes (the prefix cache never hits: every prompt differs from its first words). "
              f"Measured: each rank's hook exporter after the request ({rank_names}).", ""]
    lines.append(_table(["arm", "step", "predicted reserved (MiB)", f"measured ({rank_names})",
                         "predicted cudaMallocs", "measured", "agree"], check_rows))
    lines += ["", "### Where the growth happened, chunk step by chunk step", "",
              "Chunk steps of each request during which reserved memory grew (1 = the first chunk), predicted and "
              "as the hook's per-call log of the first rank shows them. The stock arm grows at every chunk step "
              "until its logits reach the budget and are split on rows; the fixed arm grows only in its first chunk "
              "of the run, and not at all in later requests.", ""]
    lines.append(_table(["arm", "step", "predicted growth at chunk steps", "measured (hook log)",
                         "predicted growth (MiB)", "measured (MiB)"], chunk_rows))
    first_label = labels[0]
    per_step_rows = []
    for arm in run.arms:
        step = next(s for s in summary["arms"][arm]["steps"] if s["label"] == first_label)
        growth = step["measured_chunk_step_growth_bytes_first_rank"]
        if growth:
            per_step_rows.append([arm] + [f"{g / MIB:+,.0f}" if g else "0" for g in growth])
    if per_step_rows:
        width_cells = max(len(r) for r in per_step_rows) - 1
        per_step_rows = [r + [""] * (width_cells + 1 - len(r)) for r in per_step_rows]
        lines += ["", f"Reserved growth of the first rank at each chunk step of the first request ({first_label}), "
                      "MiB, from the hook's per-call log:", ""]
        lines.append(_table(["arm"] + [str(i + 1) for i in range(width_cells)], per_step_rows))
    if host_rows:
        if shape.allocator == "sim":
            from harness.labserver.unified_memory import read_percpu_pagesets

            pcp = read_percpu_pagesets()
            explain = ("Every segment the ranks reserve is backed by host pages, so the host's MemAvailable falls "
                       "by the ranks' reserved growth, give or take two things: the background of a shared machine, "
                       "and the kernel's per-CPU free page lists. Linux 6.7+ parks just-freed pages there (PCP high "
                       "auto-tuning) and MemAvailable does not count them, so the memory a stopped server frees "
                       "reaches MemAvailable late, and the next server's first segments can be served from those "
                       "lists without MemAvailable moving (this is what usually hides most of the fixed arm's first "
                       "chunk, which runs right after the stock arm has freed its memory).")
            if pcp:
                explain += (f" On this machine these lists may hold up to {pcp['high_max_bytes'] / MIB:,.0f} MiB "
                            f"(`high_max` summed over /proc/zoneinfo); they held {pcp['count_bytes'] / MIB:,.0f} MiB "
                            "when this report was written.")
        else:
            explain = ("On this discrete GPU the ranks' reserved growth is device memory: host MemAvailable moves "
                       "only with the background of the machine.")
        lines += ["", "### Host memory against the allocator", "", explain, ""]
        lines.append(_table(["arm", "step", "reserved growth, all ranks (MiB)", "MemAvailable delta per node (MiB)"],
                            host_rows))
    lines.append("")
    return "\n".join(lines), summary


def _integrated_gpu(run: Any) -> bool:
    """Whether the lab ranks said (in the server's /version, recorded by the harness) their GPU is integrated."""
    for info in run.servers.values():
        version = info.get("version") if isinstance(info, dict) else None
        lab = version.get("lab") if isinstance(version, dict) else None
        for rank in (lab or {}).get("ranks_info") or []:
            if rank.get("integrated"):
                return True
    return False


def _rank_counter_after(run: Any, arm: str, step: str) -> dict:
    after = [s for s in run.scrapes[(arm, 0)] if s["phase"] == "after" and s["step"] == step]
    ranks = (after[-1].get("ranks") or {}) if after else {}
    return {rank: (ranks.get(rank) or {}).get("device_alloc_total") for rank in run.ranks}


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(out)


def write_notes(run_dir: Path, report: Path, shape: Any, steps: list[tuple[int, str]]) -> dict:
    """Insert the demo's section after the report's header; write demo-summary.json. Returns the summary."""
    import json

    notes, summary = build_notes(run_dir, shape, steps)
    text = report.read_text()
    if MARKER in text:  # rewritten report: replace the old section
        start = text.index(MARKER)
        end = _section_end(text, start)
        text = text[:start] + text[end:]
    cut = text.find("\n## ")
    text = text + "\n\n" + notes if cut < 0 else text[:cut + 1] + notes + "\n" + text[cut + 1:]
    report.write_text(text)
    (run_dir / "demo-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _section_end(text: str, start: int) -> int:
    """End of the demo section: the next level-2 heading after it (its own ### headings are inside)."""
    position = text.find("\n## ", start + len(MARKER) + 4)
    return len(text) if position < 0 else position + 1
