"""Plots: MemAvailable over time per node, reserved bytes per hooked call per rank, TTFT per step (PNG)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.ab.report.metrics import RequestMetrics, RunMetrics, Spread

GIB = 1024**3


def write_plots(metrics: RunMetrics, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    paths = [_mem_available(plt, metrics, node, colors, out) for node in metrics.run.nodes]
    paths += _reserved(plt, metrics, colors, out)
    paths.append(_ttft(plt, metrics, colors, out))
    return paths


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _mem_available(plt: Any, metrics: RunMetrics, node: str, colors: list[str], out: Path) -> Path:
    run = metrics.run
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, arm in enumerate(run.arms):
        color = colors[i % len(colors)]
        for r in range(run.repeats):
            points = [(s.ts, s.snapshot.mem_available_bytes) for s in run.samples[(arm, r, node)]
                      if s.snapshot.mem_available_bytes is not None]
            for scrape in run.scrapes[(arm, r)]:
                snap = scrape.nodes.get(node)
                if snap is not None and snap.mem_available_bytes is not None:
                    points.append((scrape.ts, snap.mem_available_bytes))
            if not points:
                continue
            points.sort()
            t0 = points[0][0]
            # A resumed block had a fresh serve: break the line where each serve's baseline starts.
            breaks = [sc.ts for sc in run.scrapes[(arm, r)] if sc.phase == "baseline"][1:]
            xs: list[float] = []
            ys: list[float] = []
            for ts, value in points:
                while breaks and ts >= breaks[0]:
                    xs.append(breaks.pop(0) - t0)
                    ys.append(float("nan"))
                xs.append(ts - t0)
                ys.append(value / GIB)
            ax.plot(xs, ys, color=color, alpha=1.0 if r == 0 else 0.5, label=f"{arm} r{r}")
            for step in run.steps:
                m = metrics.requests.get((arm, r, step))
                if m is not None:
                    ax.axvline(m.started_at - t0, color=color, linestyle=":", linewidth=0.8)
                    ax.axvline(m.ended_at - t0, color=color, linestyle="--", linewidth=0.8)
    ax.set_title(f"MemAvailable on {node} (dotted: request start, dashed: request end)")
    ax.set_xlabel("seconds since the arm's first scrape")
    ax.set_ylabel("MemAvailable (GiB)")
    if ax.lines:
        ax.legend(loc="best", fontsize=8)
    return _save(plt, fig, out / f"mem_available_{_safe(node)}.png")


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
                            label=f"{arm} r{r}")
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
                            color=colors[i % len(colors)], label=f"{arm} r{r}")
                    drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "no allocator data for this rank", ha="center", va="center", transform=ax.transAxes)
        else:
            ax.legend(loc="best", fontsize=8)
        ax.set_title(f"Reserved bytes after each request, {rank}")
        ax.set_ylabel("reserved (GiB)")
        paths.append(_save(plt, fig, out / f"reserved_{_safe(rank)}.png"))
    return paths


def _ttft(plt: Any, metrics: RunMetrics, colors: list[str], out: Path) -> Path:
    run = metrics.run
    fig, ax = plt.subplots(figsize=(9, 4.5))
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
    return _save(plt, fig, out / "ttft.png")


__all__ = ["write_plots"]
