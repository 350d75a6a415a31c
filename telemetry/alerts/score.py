"""Score alert rules against a corpus of timelines: lead time before each failure, failures missed, and the
benign timelines on which an alert fired (docs/alerts.md, "Scores").

A problem is a page (a `severity: critical` alert) on a benign timeline, or an alert that a failure timeline
expects (`expect`) and that did not fire before the failure, or not within its `within_s` of the onset, or not
with the severity expected (a failure that must page, caught only by a warning).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from telemetry.alerts.promtool import AlertRecord, Evaluation, evaluate_all, rule_metric_names
from telemetry.alerts.timeline import Timeline, refuse_rule_outputs, rule_outputs

PAGE = "critical"


@dataclass
class ExpectationResult:
    timeline: str
    alert: str   # the alert expected, or "any critical alert"
    fired_before_failure: bool
    lead_s: float | None  # failure time minus first firing before it
    detect_s: float | None  # first firing before the failure minus the onset (or the first record)
    within_s: float | None
    severity: str | None = None       # the severity expected ("critical": it must page)
    alert_severity: str | None = None  # the severity the rules give the alert (None: any alert of `severity`)

    @property
    def severity_ok(self) -> bool:
        return self.severity is None or self.alert_severity is None or self.alert_severity == self.severity

    @property
    def ok(self) -> bool:
        return self.fired_before_failure and self.severity_ok and (
            self.within_s is None or (self.detect_s is not None and self.detect_s <= self.within_s))


@dataclass
class AlertScore:
    alert: str
    severity: str
    caught: list[tuple[str, float]] = field(default_factory=list)  # (failure timeline, lead s)
    missed: list[str] = field(default_factory=list)  # failure timelines where it did not fire before the failure
    benign_fired: list[tuple[str, float, int]] = field(default_factory=list)  # (timeline, firing s, onsets)


@dataclass
class Score:
    rule_files: list[str]
    evaluations: list[Evaluation]
    alerts: dict[str, AlertScore]
    expectations: list[ExpectationResult]

    @property
    def problems(self) -> list[str]:
        out: list[str] = []
        for score in self.alerts.values():
            if score.severity == PAGE:
                out.extend(f"{score.alert} (critical) pages on benign timeline {name} ({onsets} time(s), "
                           f"{seconds:g} s firing)" for name, seconds, onsets in score.benign_fired)
        for result in self.expectations:
            if not result.severity_ok:
                out.append(f"{result.alert} is a {result.alert_severity} alert; {result.timeline} must be caught by a "
                           f"{result.severity} one")
            elif not result.fired_before_failure:
                out.append(f"{result.alert} misses the failure of {result.timeline}, which it is expected to catch")
            elif not result.ok:
                out.append(f"{result.alert} caught {result.timeline} {result.detect_s:g} s after the onset; "
                           f"expected within {result.within_s:g} s")
        return out


def alert_severities(rule_files: list[Path]) -> dict[str, str]:
    severities: dict[str, str] = {}
    for path in rule_files:
        data = yaml.safe_load(path.read_text()) or {}
        for group in data.get("groups", []):
            for rule in group.get("rules", []):
                if "alert" in rule:
                    severities[rule["alert"]] = str((rule.get("labels") or {}).get("severity", "none"))
    return severities


def score(timelines: list[Timeline], rule_files: list[Path]) -> Score:
    outputs = rule_outputs(rule_files)   # a timeline holds inputs, never verdicts: ConfigError before promtool
    for timeline in timelines:
        refuse_rule_outputs(timeline, outputs)
    severities = alert_severities(rule_files)
    wanted = rule_metric_names(rule_files)
    alerts = {name: AlertScore(name, severity) for name, severity in severities.items()}
    # One promtool process per CPU, each evaluating a batch of the timelines.
    evaluations = evaluate_all(timelines, rule_files, wanted, workers=os.cpu_count() or 1)
    expectations = []
    for evaluation in evaluations:
        timeline = evaluation.timeline
        outcome = timeline.outcome
        if outcome.kind == "benign":
            for name, record in evaluation.alerts.items():
                if record.firing_seconds > 0:
                    alerts.setdefault(name, AlertScore(name, severities.get(name, "none"))).benign_fired.append(
                        (timeline.name, record.firing_seconds, record.onsets))
            continue
        assert outcome.failure_at is not None
        failure_s = outcome.failure_at - timeline.start
        onset_s = 0.0 if outcome.onset_at is None else outcome.onset_at - timeline.start
        for name, score_ in alerts.items():
            before = evaluation.alerts.get(name, AlertRecord()).first_fired_before_failure_s
            if before is not None and before <= failure_s:
                score_.caught.append((timeline.name, failure_s - before))
            else:
                score_.missed.append(timeline.name)
        for expected in outcome.expect:
            if expected.alert is not None:
                candidates = [expected.alert]
            else:
                candidates = [name for name, severity in severities.items() if severity == expected.severity]
            firings = [evaluation.alerts.get(name, AlertRecord()).first_fired_before_failure_s for name in candidates]
            before = min((f for f in firings if f is not None), default=None)
            fired = before is not None and before <= failure_s
            expectations.append(ExpectationResult(
                timeline.name, expected.label, fired, failure_s - before if fired and before is not None else None,
                before - onset_s if fired and before is not None else None, expected.within_s, expected.severity,
                severities.get(expected.alert, "none") if expected.alert is not None and expected.severity else None))
    return Score([str(p) for p in rule_files], evaluations, alerts, expectations)


def as_dict(result: Score) -> dict[str, Any]:
    return {
        "rule_files": result.rule_files,
        "timelines": [{
            "name": e.timeline.name, "outcome": e.timeline.outcome.kind, "node": e.timeline.outcome.node,
            "seconds": e.timeline.end - e.timeline.start, "records": len(e.timeline.records),
            "failure_after_s": None if e.timeline.outcome.failure_at is None
            else e.timeline.outcome.failure_at - e.timeline.start,
            "alerts": {name: vars(record) for name, record in sorted(e.alerts.items())},
        } for e in result.evaluations],
        "alerts": {name: {"severity": s.severity,
                          "caught": [{"timeline": t, "lead_s": lead} for t, lead in s.caught],
                          "missed": s.missed,
                          "benign_fired": [{"timeline": t, "firing_s": sec, "onsets": n}
                                           for t, sec, n in s.benign_fired]}
                   for name, s in sorted(result.alerts.items())},
        "expectations": [vars(r) | {"ok": r.ok} for r in result.expectations],
        "problems": result.problems,
    }


def as_text(result: Score) -> str:
    lines = [f"rules: {', '.join(result.rule_files)}", ""]
    failures = [e.timeline.name for e in result.evaluations if e.timeline.outcome.kind == "failure"]
    benign = [e.timeline.name for e in result.evaluations if e.timeline.outcome.kind == "benign"]
    lines.append(f"timelines: {len(failures)} failure ({', '.join(failures) or '-'}), "
                 f"{len(benign)} benign ({', '.join(benign) or '-'})")
    lines.append("")
    claimed = {r.alert for r in result.expectations}
    shown = {name: s for name, s in sorted(result.alerts.items()) if s.caught or s.benign_fired or name in claimed}
    seconds = sum(e.timeline.end - e.timeline.start for e in result.evaluations)
    if shown:
        lines.append("alert | severity | lead time before each failure caught | failures missed | "
                     "benign timelines fired")
    else:
        lines.append(f"watched {len(result.alerts)} alerts over {seconds:.0f} s of timeline: none fired")
    for name, s in shown.items():
        caught = ", ".join(f"{t} {lead:.0f} s" for t, lead in s.caught) or "-"
        missed = f"{len(s.missed)}/{len(failures)}"
        fired = ", ".join(f"{t} ({n}x, {sec:.0f} s)" for t, sec, n in s.benign_fired) or "-"
        lines.append(f"{name} | {s.severity} | {caught} | {missed} | {fired}")
    quiet = len(result.alerts) - len(shown)
    if shown and quiet:
        lines.append(f"({quiet} other alerts neither fired nor are expected to catch a failure here)")
    if result.expectations:
        lines.append("")
        lines.append("expected catches:")
        for r in result.expectations:
            if r.fired_before_failure:
                within = "" if r.within_s is None else f" (expected within {r.within_s:g} s)"
                verdict = "ok" if r.ok else "LATE" if r.severity_ok else f"a {r.alert_severity}, NOT A PAGE"
                lines.append(f"  {r.timeline}: {r.alert} fired {r.detect_s:.0f} s after the onset, "
                             f"{r.lead_s:.0f} s before the failure{within}: {verdict}")
            else:
                lines.append(f"  {r.timeline}: {r.alert} MISSED")
    problems = result.problems
    lines.append("")
    lines.append("problems: none" if not problems else "problems:")
    lines.extend(f"  {p}" for p in problems)
    return "\n".join(lines)
