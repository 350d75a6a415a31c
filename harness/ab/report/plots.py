"""Plots: MemAvailable over time per node, reserved bytes per hooked call per rank, TTFT per step (PNG)."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from harness.ab.report.metrics import RequestMetrics, RunMetrics, Spread

GIB = 1024**3
MIB = 1024**2
ONE_REPEAT = "One repeat per arm: no noise estimate, so a gap between the arms may be noise."


def write_plots(metrics: RunMetrics, out: Path, caveats: Mapping[str, str] | None = None) -> list[Path]:
    """Every plot as PNG in `out`. `caveats` (by plot: "ttft") are written into the image itself, under the
    axes, where a reader of the picture alone sees them (a caller that knows a difference is not the effect
    under test says so there, not only in the text)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    paths = [_mem_available(plt, metrics, node, colors, out) for node in metrics.run.nodes]
    paths += _reserved(plt, metrics, colors, out)
    paths.append(_ttft(plt, metrics, colors, out, ttft_caveat(metrics, caveats)))
    return paths


def ttft_caveat(metrics: RunMetrics, caveats: Mapping[str, str] | None) -> str | None:
    """What the TTFT image must say about itself: the caller's caveat, and that one repeat has no noise estimate."""
    parts = [(caveats or {}).get("ttft"), ONE_REPEAT if metrics.run.repeats < 2 else None]
    return " ".join(p for p in parts if p) or None


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _mem_available(plt: Any, metrics: RunMetrics, node: str, colors: list[str], out: Path) -> Path:
    """One panel per step: MemAvailable during each request minus its value just before it (the node's last
    scrape before the request), against seconds since the request was sent; one line per arm and repeat.

    Deltas from each request's own start: background drift between requests (other processes, the page
    cache) would otherwise look like a difference between the arms.
    """
    run = metrics.run
    steps = run.steps
    columns = min(3, len(steps)) or 1
    rows = -(-len(steps) // columns) or 1
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False)
    for index, step in enumerate(steps):
        ax = axes[index // columns][index % columns]
        for i, arm in enumerate(run.arms):
            for r in range(run.repeats):
                m = metrics.requests.get((arm, r, step))
                if m is None:
                    continue
                before = run.scrape_before(arm, r, m.started_at)
                snap = before.nodes.get(node) if before else None
                start = snap.mem_available_bytes if snap and not snap.error else None
                if start is None:
                    continue
                points = [(0.0, 0.0)]
                points += [(s.ts - m.started_at, (s.snapshot.mem_available_bytes - start) / MIB)
                           for s in run.samples[(arm, r, node)]
                           if s.step == step and s.snapshot.mem_available_bytes is not None]
                after = run.scrape_after(arm, r, step)
                after_snap = after.nodes.get(node) if after else None
                if after_snap is not None and after_snap.mem_available_bytes is not None:
                    points.append((after.ts - m.started_at if after else 0.0,
                                   (after_snap.mem_available_bytes - start) / MIB))
                points.sort()
                ax.plot([x for x, _ in points], [y for _, y in points], color=colors[i % len(colors)],
                        linestyle="-" if r == 0 else "--", alpha=1.0 if r == 0 else 0.6,
                        label=f"{arm} repeat {r}")
        ax.axhline(0.0, color="grey", linewidth=0.6)
        ax.set_title(step, fontsize=9)
        ax.tick_params(labelsize=7)
        if index % columns == 0:
            ax.set_ylabel("Δ MemAvailable (MiB)", fontsize=8)
        if index // columns == rows - 1:
            ax.set_xlabel("s since the request was sent", fontsize=8)
    for index in range(len(steps), rows * columns):
        axes[index // columns][index % columns].set_visible(False)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for row in axes:
        for ax in row:
            for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
                if label not in labels:
                    handles.append(h)
                    labels.append(label)
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8)
    fig.suptitle(f"MemAvailable on {node}: change from each request's start", fontsize=10)
    fig.tight_layout(rect=(0, 0.08 if handles else 0, 1, 0.95))
    path = out / f"mem_available_{_safe(node)}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _reserved(plt: Any, metrics: RunMetrics, colors: list[str], out: Path) -> list[Path]:
    run = metrics.run
    hook = {(arm, r): run.hook_calls(arm, r) for arm in run.arms for r in range(run.repeats)}
    rank_ids = sorted({rank for calls in hook.values() for rank in calls})
    paths = []
    for rank_id in rank_ids:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        drawn = False
        for i, arm in enumerate(run.arms):
            for r in range(run.repeats):
                series = hook[(arm, r)].get(rank_id)
                if series is None:
                    continue
                xs, reserved = series.reserved_points()
                if len(reserved):
                    ax.plot(xs, reserved / GIB, color=colors[i % len(colors)], alpha=1.0 if r == 0 else 0.5,
                            label=f"{arm} repeat {r}")
                    drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "no allocator data: the hooked process has no CUDA allocator", ha="center",
                    va="center", transform=ax.transAxes)
        ax.set_title(f"Reserved bytes per hooked call, rank {rank_id}")
        ax.set_xlabel("hooked call")
        ax.set_ylabel("reserved (GiB)")
        if drawn:
            ax.legend(loc="best", fontsize=8)
        paths.append(_save(plt, fig, out / f"reserved_rank{rank_id}.png"))
    if rank_ids:
        return paths
    for rank in run.ranks:  # no per-call logs: reserved after each request, from the exporter
        fig, ax = plt.subplots(figsize=(9, 4.5))
        drawn = False
        for i, arm in enumerate(run.arms):
            for r in range(run.repeats):
                after = [m.ranks[rank].reserved_after_bytes if (m := metrics.requests.get((arm, r, s))) else None
                         for s in run.steps]
                if any(y is not None for y in after):
                    ax.plot(run.steps, [y / GIB if y is not None else float("nan") for y in after], marker="o",
                            color=colors[i % len(colors)], label=f"{arm} repeat {r}")
                    drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "no allocator data for this rank", ha="center", va="center", transform=ax.transAxes)
        else:
            ax.legend(loc="best", fontsize=8)
        ax.set_title(f"Reserved bytes after each request, {rank}")
        ax.set_ylabel("reserved (GiB)")
        paths.append(_save(plt, fig, out / f"reserved_{_safe(rank)}.png"))
    return paths


def _ttft(plt: Any, metrics: RunMetrics, colors: list[str], out: Path, caveat: str | None = None) -> Path:
    fig = ttft_figure(plt, metrics, colors, caveat)
    path = out / "ttft.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def ttft_figure(plt: Any, metrics: RunMetrics, colors: list[str], caveat: str | None = None) -> Any:
    """TTFT per step and arm (client and server medians), with `caveat` boxed under the axes."""
    run = metrics.run
    lines = textwrap.wrap(caveat, 110) if caveat else []
    fig, ax = plt.subplots(figsize=(9, 4.5 + 0.2 * len(lines)))
    width = 0.8 / max(1, 2 * len(run.arms))
    for i, arm in enumerate(run.arms):
        picks: tuple[tuple[str, Callable[[RequestMetrics], float | None]], ...] = (
            ("client", lambda m: m.ttft_client_s), ("server", lambda m: m.ttft_server_s))
        for j, (label, pick) in enumerate(picks):
            medians = [Spread.of(metrics.values(arm, s, pick)) for s in run.steps]
            xs = [x + (2 * i + j) * width for x in range(len(run.steps))]
            ax.bar(xs, [m.median if m else 0 for m in medians], width, label=f"{arm} {label}",
                   color=colors[i % len(colors)], alpha=1.0 if j == 0 else 0.55)
    ax.set_xticks([x + width * (len(run.arms) - 0.5) for x in range(len(run.steps))], run.steps)
    ax.set_ylabel("TTFT (s), median over repeats")
    ax.set_title("Time to first token per step")
    ax.legend(loc="best", fontsize=8)
    if not lines:
        fig.tight_layout()
        return fig
    height = 0.035 * len(lines) + 0.03
    fig.text(0.5, 0.012, "\n".join(lines), ha="center", va="bottom", fontsize=8.5, color="darkred",
             bbox={"boxstyle": "round", "facecolor": "#fff4f0", "edgecolor": "darkred"})
    fig.tight_layout(rect=(0, height + 0.02, 1, 1))
    return fig


__all__ = ["write_plots"]
