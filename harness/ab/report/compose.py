"""Compose: load → metrics → sections (the harness's and the caller's) → report.md, summary.json, plots/.

    report = Report.build(run_dir)          # the run's records and metrics, nothing written yet
    report.write(extra_sections=[...], notes={"ttft": "..."})

`write_report(run_dir)` is the same in one call. Callers add what they know (the demo's notes on the lab
server and its prediction, later statistics or verdicts) as `Section`s, placed before (`lead`) or after
(`tail`) the harness's tables, and short notes appended to a standard section by its key (`allocator`,
`mem_available`, `ttft`, `swap`, `failures`, `plots`). A section's `data` goes to summary.json under
`sections.<key>`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from harness.ab.report.load import RunData, load_run
from harness.ab.report.markdown import Document, Section
from harness.ab.report.metrics import RunMetrics, compute_metrics
from harness.ab.report.plots import write_plots
from harness.ab.report.tables import header, plots_section, standard_sections

REPORT_FILE = "report.md"
SUMMARY_FILE = "summary.json"
PLOTS_DIR = "plots"


@dataclass
class Report:
    run: RunData
    metrics: RunMetrics

    @classmethod
    def build(cls, run_dir: str | Path) -> Report:
        run = load_run(run_dir)
        return cls(run, compute_metrics(run))

    def sections(self, extra_sections: Sequence[Section] = (), plots: Sequence[Path] = ()) -> list[Section]:
        """Every section in order: the callers' lead sections, the harness's, the callers' tail ones, plots."""
        keys = [s.key for s in extra_sections]
        repeated = sorted({k for k in keys if keys.count(k) > 1})
        if repeated:
            raise ValueError(f"report sections need distinct keys; repeated: {', '.join(repeated)}")
        lead = [s for s in extra_sections if s.placement == "lead"]
        tail = [s for s in extra_sections if s.placement == "tail"]
        return [*lead, *standard_sections(self.metrics), *tail, plots_section(list(plots))]

    def summary(self, sections: Sequence[Section]) -> dict:
        run = self.run
        data = {"arms": run.arms, "steps": run.steps, "repeats": run.repeats, "nodes": run.nodes, "ranks": run.ranks,
                "status": run.status, "environment": run.environment,
                "requests": [asdict(m) for m in self.metrics.ordered()],
                "failures": [asdict(f) for f in self.metrics.failures],
                "arm_stops": [{"arm": s.arm, "repeat": s.repeat, "reason": s.reason} for s in run.stops],
                "sections": {s.key: s.data for s in sections if s.data is not None}}
        return data

    def write(self, extra_sections: Sequence[Section] = (), notes: Mapping[str, Sequence[str]] | None = None) -> Path:
        """Write report.md, summary.json and plots/*.png into the run directory; returns report.md's path."""
        run_dir = self.run.run_dir
        plots = write_plots(self.metrics, run_dir / PLOTS_DIR)
        sections = self.sections(extra_sections, plots)
        document = Document(header(self.metrics), sections, {k: list(v) for k, v in (notes or {}).items()})
        report = run_dir / REPORT_FILE
        report.write_text(document.markdown())
        (run_dir / SUMMARY_FILE).write_text(json.dumps(self.summary(sections), indent=2, default=str) + "\n")
        return report


def write_report(run_dir: str | Path, extra_sections: Sequence[Section] = (),
                 notes: Mapping[str, Sequence[str]] | None = None) -> Path:
    """Write report.md, summary.json and plots/*.png for a run directory; returns report.md's path."""
    return Report.build(run_dir).write(extra_sections, notes)


__all__ = ["PLOTS_DIR", "REPORT_FILE", "SUMMARY_FILE", "Report", "write_report"]
