"""Compose: load → metrics → verdict → sections (the harness's and the caller's) → report.md, summary.json, plots/.

    report = Report.build(run_dir)          # the run's records, metrics and verdict, nothing written yet
    report.write(extra_sections=[...], notes={"ttft": "..."})
    report.verdict.exit_code                # what `memtel ab run` / `ab report` exit with (verdict.py)

`write_report(run_dir)` is the same in one call. Callers add what they know (the demo's notes on the lab
server and its prediction, later statistics or verdicts) as `Section`s, placed before (`lead`) or after
(`tail`) the harness's tables, and short notes appended to a standard section by its key (`allocator`,
`mem_available`, `ttft`, `swap`, `failures`, `plots`). A section's `data` goes to summary.json under
`sections.<key>`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harness.ab.report.extras import EXTRAS_FILE, ReportExtras, load_extras, save_extras
from harness.ab.report.load import RunData, load_run
from harness.ab.report.markdown import Document, Section
from harness.ab.report.metrics import RunMetrics, compute_metrics
from harness.ab.report.plots import write_plots
from harness.ab.report.tables import header, history_section, plot_captions, plots_section, standard_sections
from harness.ab.report.verdict import Verdict, gates_section, verdict

REPORT_FILE = "report.md"
SUMMARY_FILE = "summary.json"
PLOTS_DIR = "plots"


@dataclass
class Report:
    run: RunData
    metrics: RunMetrics
    verdict: Verdict = field(init=False)

    def __post_init__(self) -> None:
        self.verdict = verdict(self.metrics)

    @classmethod
    def build(cls, run_dir: str | Path) -> Report:
        run = load_run(run_dir)
        return cls(run, compute_metrics(run))

    def sections(self, extra_sections: Sequence[Section] = (), plots: Sequence[Path] = ()) -> list[Section]:
        """Every section in order: gates and the run's history (when there are any), the callers' lead sections,
        the harness's, the callers' tail ones, plots."""
        keys = [s.key for s in extra_sections]
        repeated = sorted({k for k in keys if keys.count(k) > 1})
        if repeated:
            raise ValueError(f"report sections need distinct keys; repeated: {', '.join(repeated)}")
        own = [s for s in (gates_section(self.verdict), history_section(self.metrics)) if s is not None]
        lead = [s for s in extra_sections if s.placement == "lead"]
        tail = [s for s in extra_sections if s.placement == "tail"]
        return [*own, *lead, *standard_sections(self.metrics), *tail,
                plots_section(list(plots), plot_captions(self.metrics, list(plots)))]

    def summary(self, sections: Sequence[Section]) -> dict:
        run = self.run
        end = run.run_end
        data = {"verdict": self.verdict.as_dict(), "arms": run.arms, "steps": run.steps, "repeats": run.repeats,
                "nodes": run.nodes, "ranks": run.ranks, "status": run.status, "environment": run.environment,
                "arm_environment": {arm: serves[0].env for (arm, repeat), serves in sorted(run.serves.items())
                                    if repeat == 0 and serves},
                "harness": {"cpu_s": end.cpu_s if end else None, "max_rss_bytes": end.max_rss_bytes if end else None,
                            "tokenize_calls": sum(p.tokenize_calls for p in run.prompts.values()),
                            "tokenize_s": sum(p.tokenize_s or 0.0 for p in run.prompts.values())},
                "requests": [asdict(m) for m in self.metrics.ordered()],
                "failures": [asdict(f) for f in self.metrics.failures],
                "arm_stops": [{"arm": s.arm, "repeat": s.repeat, "reason": s.reason} for s in run.stops],
                "sections": {s.key: s.data for s in sections if s.data is not None}}
        return data

    def write(self, extra_sections: Sequence[Section] = (), notes: Mapping[str, Sequence[str]] | None = None,
              plot_caveats: Mapping[str, str] | None = None) -> Path:
        """Write report.md, summary.json and plots/*.png into the run directory; returns report.md's path.
        `plot_caveats` (by plot: "ttft") are written into the images (plots.write_plots).

        They are created private (0600, plots/ 0700), as the rest of a run (harness/ab/rundir.py).
        """
        from harness.ab.rundir import inside_run_dir, private_files

        for name in (REPORT_FILE, SUMMARY_FILE, PLOTS_DIR, EXTRAS_FILE):  # a symbolic link planted there is refused
            inside_run_dir(self.run.run_dir, name, what="the report's")
        extras = ReportExtras(tuple(extra_sections), notes, plot_caveats)
        with private_files():
            if extras:  # kept for `memtel ab report` to write again (harness/ab/report/extras.py)
                save_extras(self.run.run_dir, extras, _finite)
            return self._write(extra_sections, notes, plot_caveats)

    def write_again(self) -> Path:
        """Write the report again with what its first writer added (the demo's section, notes, plot caveats)."""
        from harness.ab.rundir import inside_run_dir

        inside_run_dir(self.run.run_dir, EXTRAS_FILE, what="the report's")  # never read through a link out
        extras = load_extras(self.run.run_dir)
        return self.write(extras.sections, extras.notes, extras.plot_caveats)

    def _write(self, extra_sections: Sequence[Section], notes: Mapping[str, Sequence[str]] | None,
               plot_caveats: Mapping[str, str] | None = None) -> Path:
        run_dir = self.run.run_dir
        plots = write_plots(self.metrics, run_dir / PLOTS_DIR, plot_caveats)
        sections = self.sections(extra_sections, plots)
        document = Document(header(self.metrics, self.verdict.line), sections,
                            {k: list(v) for k, v in (notes or {}).items()})
        report = run_dir / REPORT_FILE
        report.write_text(document.markdown())
        # Numbers stay numbers (formatting is the Markdown's job); NaN and infinity (a scrape can carry them)
        # are not JSON: they are written as null.
        summary = _finite(self.summary(sections))
        (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
        return report


def _finite(value: Any) -> Any:
    """`value` as plain JSON: NaN and infinity as None, numpy scalars as Python numbers."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_report(run_dir: str | Path, extra_sections: Sequence[Section] = (),
                 notes: Mapping[str, Sequence[str]] | None = None) -> Path:
    """Write report.md, summary.json and plots/*.png for a run directory; returns report.md's path."""
    return Report.build(run_dir).write(extra_sections, notes)


__all__ = ["PLOTS_DIR", "REPORT_FILE", "SUMMARY_FILE", "Report", "write_report"]
