"""The verdict: the ladder's gates evaluated on a run's metrics, the run's outcome, its exit code, one line.

Exit codes of `memtel ab run` and `memtel ab report` (docs/harness.md, "Exit codes"), by precedence:

| code | outcome | when |
| --- | --- | --- |
| 130 | interrupted | Ctrl-C or SIGTERM (`ab run` only; the command line decides it) |
| 2 | bad input | the ladder, a flag or a run directory is wrong (raised before this is evaluated) |
| 1 | NOTHING RAN | no request was made (every arm failed to start) |
| 3 | GATE FAILED | a gate failed, or had no value to check (failed requests too: 3 wins) |
| 4 | REQUESTS FAILED | a request failed or a step was skipped, and every gate passed (or there are none) |
| 1 | UNFINISHED | the run did not finish (`ab report` of an interrupted run), nothing else wrong |
| 0 | PASS / COMPLETED | every request ok; every gate passed (PASS) or there are none (COMPLETED: nothing judged) |

A gate is checked on the successful requests in its scope. Values that are missing (a failed request, an
exporter that did not answer, a series the exporter does not have) are listed with the reason; a gate
with no value at all to check fails ("no data"): a CI gate must not pass on nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from harness.ab.gates import GATES, TTFT_REGRESSION, Gate
from harness.ab.report import markdown as md
from harness.ab.report.markdown import Section, Table
from harness.ab.report.metrics import RequestMetrics, RunMetrics
from harness.ab.report.stats import (
    NO_DATA,
    NO_DIFFERENCE,
    NO_NOISE_ESTIMATE,
    SIGNIFICANT,
    Estimate,
    PairedDifference,
)
from telemetry.catalogue.fields import NODE_SNAPSHOT_SERIES

MIB = 1024 * 1024

EXIT_OK = 0
EXIT_RUN_ERROR = 1
EXIT_BAD_INPUT = 2
EXIT_GATE_FAILED = 3
EXIT_REQUESTS_FAILED = 4
EXIT_INTERRUPTED = 130

PASS, FAIL, NO_VALUE = "pass", "fail", "no data"
COMPLETED = "COMPLETED"  # every request completed and the ladder has no gates: a run outcome, not a judgement

# What each gate reads from a request, on which part (ranks or nodes), and which way is worse.
_MEASURES: dict[str, tuple[str, str, float, str]] = {
    # name: (part, RequestMetrics part field, scale to the gate's unit, "max" (at most) or "min" (at least))
    "max_reserved_growth_mib": ("ranks", "reserved_growth_bytes", MIB, "max"),
    "min_headroom_mib": ("nodes", "headroom_min_bytes", MIB, "min"),
    "min_mem_available_mib": ("nodes", "mem_available_min_bytes", MIB, "min"),
    "max_nv_err_events": ("nodes", "nv_err_no_memory", 1.0, "max"),
}
_UNIT = {"max_reserved_growth_mib": " MiB", "min_headroom_mib": " MiB", "min_mem_available_mib": " MiB",
         "max_nv_err_events": "", "max_ttft_regression_pct": " %"}
_ABSENT = {
    "reserved_growth_bytes": "exports no allocator series (no CUDA allocator in the hooked process?)",
    "headroom_min_bytes": f"exports no {NODE_SNAPSHOT_SERIES['unified_headroom_bytes']} (its headroom collector "
                          "failed?)",
    "mem_available_min_bytes": f"exports no {NODE_SNAPSHOT_SERIES['mem_available_bytes']}",
    "nv_err_no_memory": f"exports no {NODE_SNAPSHOT_SERIES['nv_err_no_memory_total']}",
}


@dataclass(frozen=True)
class GateResult:
    gate: Gate
    status: str  # pass, fail, no data
    observed: float | None  # the worst value checked, in the gate's unit (MiB, events, %)
    where: str | None  # where the worst value was
    checked: int  # values checked
    missing: list[str] = field(default_factory=list)  # values that could not be checked, with the reason

    @property
    def passed(self) -> bool:
        return self.status == PASS

    def observed_text(self) -> str:
        if self.observed is None:
            return "n/a"
        signed = self.gate.name in ("max_reserved_growth_mib", TTFT_REGRESSION)
        digits = 0 if self.gate.name == "max_nv_err_events" else 1
        return md.number(self.observed, digits=digits, sign=signed) + _UNIT[self.gate.name]

    def as_dict(self) -> dict[str, Any]:
        return {"gate": self.gate.name, "limit": self.gate.limit, "arm": self.gate.arm, "step": self.gate.step,
                "baseline": self.gate.baseline, "status": self.status, "observed": self.observed,
                "where": self.where, "checked": self.checked, "missing": self.missing}


def _in_scope(metrics: RunMetrics, gate: Gate) -> Iterator[RequestMetrics]:
    for m in metrics.ordered():
        if gate.arm in (None, m.arm) and gate.step in (None, m.step):
            yield m


def _who(m: RequestMetrics) -> str:
    return f"{m.arm} repeat {m.repeat} {m.step}"


def evaluate_gate(metrics: RunMetrics, gate: Gate) -> GateResult:
    if gate.name == TTFT_REGRESSION:
        return _ttft_regression(metrics, gate)
    part, name, scale, worse = _MEASURES[gate.name]
    run = metrics.run
    worst: tuple[float, str] | None = None
    checked = 0
    missing: list[str] = []
    names = run.ranks if part == "ranks" else run.nodes
    if not names:
        missing.append(f"the ladder has no {part}: nothing to read this from")
    for m in _in_scope(metrics, gate):
        if not m.ok:
            missing.append(f"{_who(m)}: the request failed")
            continue
        for who in names:
            values = m.ranks if part == "ranks" else m.nodes
            item = values.get(who)
            value = getattr(item, name) if item is not None else None
            if value is None:
                error = item.error if item is not None else None
                missing.append(f"{part[:-1]} {who}: " + (f"did not answer ({error})" if error else _ABSENT[name]))
                continue
            checked += 1
            value = value / scale
            if worst is None or (value > worst[0] if worse == "max" else value < worst[0]):
                worst = (value, f"{_who(m)}, {part[:-1]} {who}")
    for f in metrics.failures:
        if f.kind != "not run" and gate.arm in (None, f.arm) and gate.step in (None, f.step) \
                and (f.arm, f.repeat, f.step) not in metrics.requests:
            missing.append(f"{f.arm} repeat {f.repeat} {f.step}: {f.kind}")
    if worst is None:
        return GateResult(gate, NO_VALUE, None, None, 0, missing)
    ok = worst[0] <= gate.limit if worse == "max" else worst[0] >= gate.limit
    return GateResult(gate, PASS if ok else FAIL, worst[0], worst[1], checked, missing)


def _ttft_regression(metrics: RunMetrics, gate: Gate) -> GateResult:
    run = metrics.run
    assert gate.baseline is not None
    arms = [a for a in run.arms if a != gate.baseline and gate.arm in (None, a)]
    worst: tuple[float, str] | None = None
    checked = 0
    missing: list[str] = []
    for step in run.steps:
        if gate.step not in (None, step):
            continue
        base = Estimate.of(metrics.values(gate.baseline, step, lambda m: m.ttft_client_s))
        for arm in arms:
            mine = Estimate.of(metrics.values(arm, step, lambda m: m.ttft_client_s))
            if base is None or mine is None or base.mean <= 0:
                missing.append(f"{arm} against {gate.baseline} at {step}: no successful request with a TTFT in "
                               f"{gate.baseline if base is None else arm}")
                continue
            checked += 1
            pct = (mine.mean - base.mean) / base.mean * 100.0
            if worst is None or pct > worst[0]:
                worst = (pct, f"{arm} at {step}: {mine.mean:,.3f} s against {base.mean:,.3f} s (means over "
                              f"{mine.n} and {base.n} repeats)")
    if worst is None:
        return GateResult(gate, NO_VALUE, None, None, 0, missing)
    return GateResult(gate, PASS if worst[0] <= gate.limit else FAIL, worst[0], worst[1], checked, missing)


@dataclass(frozen=True)
class Verdict:
    outcome: str  # PASS, COMPLETED, GATE FAILED, REQUESTS FAILED, NOTHING RAN, UNFINISHED
    exit_code: int
    line: str  # the report's first line after the title (Markdown)
    gates: list[GateResult]
    requests_expected: int
    requests_ok: int
    requests_failed: int  # failed or skipped
    requests_not_run: int
    ladder_difference: PairedDifference | None  # first arm − second arm, reserved growth over the ladder

    def as_dict(self) -> dict[str, Any]:
        difference = self.ladder_difference
        return {"outcome": self.outcome, "exit_code": self.exit_code, "line": _plain_line(self.line),
                "gates": [g.as_dict() for g in self.gates], "requests_expected": self.requests_expected,
                "requests_ok": self.requests_ok, "requests_failed": self.requests_failed,
                "requests_not_run": self.requests_not_run,
                "reserved_growth_over_ladder_difference": asdict(difference) if difference else None}


def _plain_line(line: str) -> str:
    return line.replace("**", "")


def verdict(metrics: RunMetrics) -> Verdict:
    run = metrics.run
    gates = [evaluate_gate(metrics, gate) for gate in run.ladder.gates]
    expected = len(run.arms) * run.repeats * len(run.steps)
    ok = sum(1 for m in metrics.requests.values() if m.ok)
    failed = sum(1 for f in metrics.failures if f.kind in ("failed", "skipped"))
    not_run = sum(1 for f in metrics.failures if f.kind == "not run")
    bad_gates = [g for g in gates if not g.passed]
    unfinished = run.status != "complete" or not_run > 0
    if not metrics.requests:
        outcome, code = "NOTHING RAN", EXIT_RUN_ERROR
    elif bad_gates:
        outcome, code = "GATE FAILED", EXIT_GATE_FAILED
    elif failed:
        outcome, code = "REQUESTS FAILED", EXIT_REQUESTS_FAILED
    elif unfinished:
        outcome, code = "UNFINISHED", EXIT_RUN_ERROR
    else:
        # Without gates nothing was judged: the outcome says only that the requests completed, not that a fix works.
        outcome, code = ("PASS" if gates else COMPLETED), EXIT_OK
    difference = metrics.paired_blocks(run.arms[0], run.arms[1]) if len(run.arms) >= 2 else None
    parts = []
    if not metrics.requests:
        why = "every arm failed to start" if run.stops else "the run stopped before its first request"
        parts.append(f"no request was made ({why})")
    if gates:
        if bad_gates:
            first = bad_gates[0]
            more = f" (+{len(bad_gates) - 1} more)" if len(bad_gates) > 1 else ""
            observed = "no value to check" if first.status == NO_VALUE else f"{first.observed_text()} at {first.where}"
            parts.append(f"{len(bad_gates)} of {len(gates)} gates failed: {first.gate.describe()}: {observed}{more}")
        else:
            parts.append(f"{len(gates)} of {len(gates)} gates pass")
    if metrics.requests:
        text = f"{ok} of {expected} requests ok"
        if failed:
            text += f", {failed} failed or skipped"
        if not_run:
            text += f", {not_run} not run yet"
        parts.append(text)
    if outcome == COMPLETED:
        parts.append("no gates, so nothing was judged against a limit")
    if difference is not None and metrics.requests:
        parts.append(f"{difference.a} − {difference.b} reserved growth over the ladder, all ranks: "
                     f"{_difference_text(difference)}")
    line = f"**Verdict: {outcome}** — " + "; ".join(parts) + "."
    return Verdict(outcome, code, line, gates, expected, ok, failed, not_run, difference)


def _difference_text(d: PairedDifference) -> str:
    e = d.estimate
    if d.verdict == NO_DATA or e is None:
        return "not known (no allocator data for every step)"
    mean = md.number(e.mean, MIB, sign=True) + " MiB"
    if d.verdict == NO_NOISE_ESTIMATE:
        return f"{mean} (one repeat: no noise estimate)"
    if d.verdict == NO_DIFFERENCE:
        return f"no difference (identical in all {e.n} repeats)"
    if d.verdict == SIGNIFICANT and e.sd == 0:
        return f"{mean} (significant: the same in all {e.n} repeats)"
    return f"{mean} ({d.verdict}; 95 % interval {md.interval(e, MIB, sign=True)} MiB, {e.n} repeats)"


def _missing_text(missing: list[str]) -> str:
    counts = Counter(missing)
    parts = [f"{reason}" + (f" (×{n})" if n > 1 else "") for reason, n in counts.items()]
    if len(parts) > 4:
        parts = [*parts[:4], f"and {len(parts) - 4} more"]
    return "; ".join(parts)


def gates_section(v: Verdict) -> Section | None:
    if not v.gates:
        return None
    rows = []
    for g in v.gates:
        scope = ", ".join(x for x in (f"arm {g.gate.arm}" if g.gate.arm else "every arm",
                                      f"against {g.gate.baseline}" if g.gate.baseline else "",
                                      f"step {g.gate.step}" if g.gate.step else "every step") if x)
        status = {PASS: "pass", FAIL: "**FAIL**", NO_VALUE: "**FAIL** (no data)"}[g.status]
        rows.append([g.gate.name, scope, f"{g.gate.limit:g}{_UNIT[g.gate.name]}", g.observed_text(), g.where or "n/a",
                     str(g.checked), status])
    table = Table(["gate", "scope", "limit", "worst observed", "where", "values checked", "result"], rows)
    notes = [f"- {g.gate.describe()}: not checked: {_missing_text(g.missing)}" for g in v.gates if g.missing]
    body = ("Each gate, checked on every successful request in its scope (what each checks: docs/harness.md, "
            "\"Gates\"). A gate with no value to check fails. Exit code of `memtel ab run` / `memtel ab report`: "
            f"{v.exit_code}.\n\n" + table.markdown())
    if notes:
        body += "\n\nValues that could not be checked:\n\n" + "\n".join(notes)
    return Section("gates", "Gates", body, placement="lead", data=[g.as_dict() for g in v.gates])


__all__ = ["EXIT_BAD_INPUT", "EXIT_GATE_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_REQUESTS_FAILED",
           "EXIT_RUN_ERROR", "GATES", "GateResult", "Verdict", "evaluate_gate", "gates_section", "verdict"]
