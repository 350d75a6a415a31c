"""The statistics section: per arm and step the mean, sd and 95 % t-interval over repeats, and the paired
difference of the first arm and each other arm, for reserved growth, the MemAvailable low point and TTFT.

The numbers come from `RunMetrics.estimate` / `paired` / `paired_blocks` (harness/ab/report/stats.py has the
method); this module only chooses the metrics and writes the section and its summary.json data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from harness.ab.report import markdown as md
from harness.ab.report.markdown import Section, Table
from harness.ab.report.metrics import RequestMetrics, RunMetrics
from harness.ab.report.stats import CONFIDENCE, Estimate, PairedDifference

MIB = 1024 * 1024
LADDER = "over the ladder"  # the step label of the block totals

# How the pairs of each arm order sit in time (the ladder's `order`, harness/ab/config.py ARM_ORDERS).
PAIRING = {
    "ABAB": "run side by side: this run's `order: ABAB` serves each arm in turn within every repeat",
    "AABB": "run apart: this run's `order: AABB` serves every repeat of one arm before the next arm, so a "
            "pair's requests are separated by the other arm's blocks and drift of the machine between them counts "
            "as a difference; `order: ABAB` puts them side by side",
}


def method(order: str, repeats: int = 2) -> str:
    """The statistics' method, saying how this run's `order` placed the pairs."""
    pairing = PAIRING.get(order, f"this run's `order: {order}`")
    if repeats < 2:  # one block per arm: ABAB and AABB run the same schedule
        pairing = f"this run's `order: {order}` with one repeat: one block of each arm, one after the other"
    return ("Per arm and step: the mean over repeats, its sample standard deviation (sd) and a 95 % t-interval "
            "(mean ± t(0.975, n − 1) · sd / √n). A − B: the paired difference, pairs being the two arms' requests "
            f"of the same repeat and step ({pairing}), with the same interval over the "
            "differences. **significant**: the interval excludes 0 (or the difference is the same non-zero amount "
            "in every repeat); **within the noise**: it contains 0, so no difference can be claimed; **no "
            "difference**: identical in every repeat. Each interval is at 95 %: in an A/A run about one interval "
            "in twenty excludes 0 by chance.")


@dataclass(frozen=True)
class MetricSpec:
    key: str  # summary.json's name
    title: str
    unit: str  # bytes or s
    pick: Callable[[RequestMetrics], float | None]


@dataclass(frozen=True)
class Comparison:
    """One metric at one step (or over the ladder): each arm's estimate and the paired differences."""

    metric: str
    step: str
    unit: str
    arms: dict[str, Estimate | None]
    differences: list[PairedDifference]

    def as_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "step": self.step, "unit": self.unit,
                "arms": {arm: asdict(e) if e else None for arm, e in self.arms.items()},
                "differences": [asdict(d) for d in self.differences]}


def metric_specs(metrics: RunMetrics) -> list[MetricSpec]:
    specs = [MetricSpec("reserved_growth_bytes", "Reserved growth during the request, all ranks (MiB)", "bytes",
                        lambda m: m.reserved_growth_bytes)]
    for node in metrics.run.nodes:
        specs.append(MetricSpec(f"mem_available_min_delta_bytes:{node}",
                                f"MemAvailable low point on {node}, from the request's start (MiB)", "bytes",
                                _low_point(node)))
    specs.append(MetricSpec("ttft_client_s", "TTFT, client (s)", "s", lambda m: m.ttft_client_s))
    return specs


def _low_point(node: str) -> Callable[[RequestMetrics], float | None]:
    return lambda m: m.nodes[node].mem_available_min_delta_bytes


def comparisons(metrics: RunMetrics) -> list[Comparison]:
    run = metrics.run
    first, others = run.arms[0], run.arms[1:]
    out = []
    for spec in metric_specs(metrics):
        for step in run.steps:
            out.append(Comparison(spec.key, step, spec.unit,
                                  {arm: metrics.estimate(arm, step, spec.pick) for arm in run.arms},
                                  [metrics.paired(first, other, step, spec.pick) for other in others]))
        if spec.key == "reserved_growth_bytes":
            out.append(Comparison(spec.key, LADDER, spec.unit,
                                  {arm: Estimate.of([metrics.block_reserved_growth(arm, r)
                                                     for r in range(run.repeats)]) for arm in run.arms},
                                  [metrics.paired_blocks(first, other) for other in others]))
    return out


def _cell(e: Estimate | None, unit: str) -> str:
    scale, digits, sign = (MIB, 1, True) if unit == "bytes" else (1.0, 3, False)
    if e is None:
        return "n/a"
    text = md.estimate(e, scale, digits, sign)
    return text if e.sd is None else f"{text} (sd {md.number(e.sd, scale, digits)})"


def _difference_cell(d: PairedDifference, unit: str) -> str:
    scale, digits, suffix = (MIB, 1, " MiB") if unit == "bytes" else (1.0, 3, " s")
    text = md.difference(d, scale, suffix, digits)
    if d.estimate is not None and d.estimate.low is not None and d.estimate.sd:
        text += f", 95 % {md.interval(d.estimate, scale, digits, sign=True)}"
    return text


def statistics_section(metrics: RunMetrics) -> Section:
    run = metrics.run
    if len(run.arms) < 2:
        return Section("statistics", "5. Differences between the arms", "One arm: nothing to compare.")
    items = comparisons(metrics)
    text = method(run.ladder.order, run.repeats)
    intro = [text]
    if run.repeats < 2:
        intro.append("**One repeat: no noise estimate exists.** Every difference below is a single value; it cannot "
                     "be called significant or within the noise. Run with `repeats: 2` or more to get intervals "
                     "(with `order: ABAB` their pairs run side by side).")
    parts = ["\n\n".join(intro)]
    for spec in metric_specs(metrics):
        mine = [c for c in items if c.metric == spec.key]
        if all(e is None for c in mine for e in c.arms.values()):
            parts.append(f"### {spec.title}\n\nn/a: no successful request has this value (the tables above say "
                         "why under their n/a cells).")
            continue
        rows = []
        for c in mine:
            rows.append([c.step, *[_cell(c.arms[arm], c.unit) for arm in run.arms],
                         *[_difference_cell(d, c.unit) for d in c.differences]])
        head = ["step", *[f"{arm}: mean ± 95 %" for arm in run.arms],
                *[f"{run.arms[0]} − {other} (paired)" for other in run.arms[1:]]]
        parts.append(f"### {spec.title}\n\n" + Table(head, rows).markdown())
    data = {"confidence": CONFIDENCE, "method": text.replace("**", ""), "repeats": run.repeats,
            "comparisons": [c.as_dict() for c in items]}
    return Section("statistics", "5. Differences between the arms", "\n\n".join(parts), data=data)


__all__ = ["LADDER", "PAIRING", "Comparison", "comparisons", "method", "metric_specs", "statistics_section"]
