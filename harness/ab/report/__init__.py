"""The comparison report of a run directory, in stages: load → metrics → verdict → tables → Markdown and plots.

- `load.load_run(run_dir) -> RunData`: results.jsonl as typed records, grouped (a superseded block attempt
  left out); the hook's call logs (`RunData.hook_calls(arm, repeat) -> {rank: CallSeries}`, numpy columns
  in time order).
- `metrics.compute_metrics(run) -> RunMetrics`: one `RequestMetrics` per request (nodes, ranks, where the
  hook saw the growth), failures, and `values` / `spread` / `estimate` / `paired` over repeats
  (`stats`: the t-interval and the paired difference).
- `verdict.verdict(metrics) -> Verdict`: the ladder's gates, the outcome, the exit code, the one line.
- `tables`: the harness's sections (header, run history, allocator growth, MemAvailable, TTFT, swap and driver
  errors, failures, plots); `comparisons`: the statistics section.
- `markdown`: `Table`, `Section`, the cell formats. `plots.write_plots`.
- `compose.Report` / `write_report(run_dir, extra_sections=(), notes=None)`: writes report.md, summary.json
  and plots/; callers pass their own sections and notes in.
"""

from harness.ab.report.compose import Report, write_report
from harness.ab.report.hook_calls import CallSeries
from harness.ab.report.load import RunData, RunDirectoryError, load_run
from harness.ab.report.markdown import Section, Table
from harness.ab.report.metrics import (
    Failure,
    HookGrowth,
    NodeRequestMetrics,
    RankRequestMetrics,
    RequestMetrics,
    RunMetrics,
    Spread,
    compute_metrics,
    growth_location,
)
from harness.ab.report.stats import Estimate, PairedDifference
from harness.ab.report.verdict import Verdict

__all__ = [
    "CallSeries",
    "Estimate",
    "Failure",
    "HookGrowth",
    "NodeRequestMetrics",
    "PairedDifference",
    "RankRequestMetrics",
    "Report",
    "RequestMetrics",
    "RunData",
    "RunDirectoryError",
    "RunMetrics",
    "Section",
    "Spread",
    "Table",
    "Verdict",
    "compute_metrics",
    "growth_location",
    "load_run",
    "write_report",
]
