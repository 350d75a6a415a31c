"""Load: a run directory's results.jsonl (and the hook's call logs) as typed records, grouped for the report.

Reads only files, so a report can be rewritten at any time, also for a run that is still going or was
interrupted. Records of a superseded block attempt (before its `block_superseded` record: `--resume` ran
the block again from its first step) are left out, and so are the hook's calls made before it; what was
superseded is kept in `RunData.superseded` so the report can say so.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.ab.config import Ladder
from harness.ab.records import (
    RESULTS_FILE,
    ArmStopped,
    BlockSuperseded,
    NodeSample,
    PromptBuilt,
    RequestDone,
    RunEnd,
    RunStart,
    Scrape,
    ServerInfo,
    ServeStart,
    StepKey,
    StepSkipped,
    current_records,
    read_records,
)
from harness.ab.report.hook_calls import CallSeries
from telemetry.errors import ConfigError
from telemetry.hook.call_log import read_call_columns

BlockKey = tuple[str, int]  # (arm, repeat)


class RunDirectoryError(ConfigError):
    """The directory holds no run of `memtel ab run` (or not a readable one)."""


@dataclass
class RunData:
    """Everything one run recorded, grouped the way the report reads it."""

    run_dir: Path
    ladder: Ladder
    environment: dict[str, Any]
    requests: dict[StepKey, RequestDone] = field(default_factory=dict)
    skipped: dict[StepKey, str] = field(default_factory=dict)  # -> reason
    scrapes: dict[BlockKey, list[Scrape]] = field(default_factory=lambda: defaultdict(list))  # by time
    samples: dict[tuple[str, int, str], list[NodeSample]] = field(default_factory=lambda: defaultdict(list))
    prompts: dict[tuple[str, int], PromptBuilt] = field(default_factory=dict)  # (step, repeat) ->
    hook_dirs: dict[BlockKey, set[str]] = field(default_factory=lambda: defaultdict(set))
    stops: list[ArmStopped] = field(default_factory=list)
    status: str | None = None  # run_end's status; None: unfinished
    run_end: RunEnd | None = None  # the last run_end (the harness's own cost is on it)
    servers: dict[str, ServerInfo] = field(default_factory=dict)  # arm -> its first server_info
    serves: dict[BlockKey, list[ServeStart]] = field(default_factory=lambda: defaultdict(list))  # that count
    superseded: list[BlockSuperseded] = field(default_factory=list)  # in file order
    resumes: int = 0  # run_start records after the first (`--resume`)
    _hook_calls: dict[BlockKey, dict[int, CallSeries]] = field(default_factory=dict, repr=False)

    @property
    def arms(self) -> list[str]:
        return [arm.name for arm in self.ladder.arms]

    @property
    def steps(self) -> list[str]:
        return [step.label for step in self.ladder.steps]

    @property
    def repeats(self) -> int:
        return self.ladder.repeats

    @property
    def nodes(self) -> list[str]:
        return list(self.ladder.nodes)

    @property
    def ranks(self) -> list[str]:
        """Rank names of the ladder and of every arm's own ranks, in order."""
        names = dict(self.ladder.ranks)
        for arm in self.ladder.arms:
            names.update(arm.ranks or {})
        return list(names)

    def scrape_after(self, arm: str, repeat: int, step: str) -> Scrape | None:
        after = [s for s in self.scrapes[(arm, repeat)] if s.phase == "after" and s.step == step]
        return after[-1] if after else None

    def scrape_before(self, arm: str, repeat: int, started_at: float) -> Scrape | None:
        before = [s for s in self.scrapes[(arm, repeat)] if s.ts <= started_at]
        return before[-1] if before else None

    def block_superseded_at(self, arm: str, repeat: int) -> float | None:
        """When the block's last superseded attempt was given up (its later records are the ones that count)."""
        times = [s.ts for s in self.superseded if (s.arm, s.repeat) == (arm, repeat)]
        return max(times) if times else None

    def hook_calls(self, arm: str, repeat: int) -> dict[int, CallSeries]:
        """rank -> its calls in time order, from every call log of this block's hook directories (read once);
        calls of a superseded attempt of the block are left out."""
        key = (arm, repeat)
        if key not in self._hook_calls:
            dirs = [Path(d) if Path(d).is_absolute() else self.run_dir / d for d in sorted(self.hook_dirs.get(key, ()))]
            since = self.block_superseded_at(arm, repeat)
            columns = sorted(read_call_columns(*dirs).items())
            series = {rank: CallSeries.from_columns(values) for rank, values in columns}
            if since is not None:
                series = {rank: calls.since(since) for rank, calls in series.items()}
            self._hook_calls[key] = {rank: calls for rank, calls in series.items() if len(calls)}
        return self._hook_calls[key]


def load_run(run_dir: str | Path) -> RunData:
    run_dir = Path(run_dir)
    results = run_dir / RESULTS_FILE
    if not results.exists():
        raise RunDirectoryError(f"{results} does not exist: not a run directory of `memtel ab run`")
    all_records = read_records(results)
    starts = [r for r in all_records if isinstance(r, RunStart)]
    if not starts:
        raise RunDirectoryError(f"{results} has no run_start record")
    run = RunData(run_dir=run_dir, ladder=starts[0].ladder, environment=starts[0].environment)
    run.superseded = [r for r in all_records if isinstance(r, BlockSuperseded)]
    run.resumes = len(starts) - 1
    records = current_records(all_records)
    for arm in run.ladder.arms:
        if arm.hook_log_dir:
            for repeat in range(run.repeats):
                run.hook_dirs[(arm.name, repeat)].add(arm.hook_log_dir)
    for r in records:
        if isinstance(r, RequestDone):
            run.requests[(r.arm, r.repeat, r.step)] = r
            run.skipped.pop((r.arm, r.repeat, r.step), None)
        elif isinstance(r, StepSkipped):
            run.skipped[(r.arm, r.repeat, r.step)] = r.reason
        elif isinstance(r, Scrape):
            run.scrapes[(r.arm, r.repeat)].append(r)
        elif isinstance(r, NodeSample):
            run.samples[(r.arm, r.repeat, r.node)].append(r)
        elif isinstance(r, PromptBuilt):
            run.prompts[(r.step, r.repeat)] = r
        elif isinstance(r, ServeStart):
            run.serves[(r.arm, r.repeat)].append(r)
            if r.hook_log_dir:
                run.hook_dirs[(r.arm, r.repeat)].add(r.hook_log_dir)
        elif isinstance(r, ArmStopped):
            run.stops.append(r)
        elif isinstance(r, RunEnd):
            run.status = r.status
            run.run_end = r
        elif isinstance(r, ServerInfo):
            run.servers.setdefault(r.arm, r)
    return run


__all__ = ["BlockKey", "RunData", "RunDirectoryError", "load_run"]
