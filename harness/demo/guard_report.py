"""`memtel demo --guard`'s record and report: what each phase's requests got, the burst phases' numbers, the facts the
demo's exit status rests on (`verdict`, `shown_as_expected`), guard-report.md and guard-summary.json.

The run (harness/demo/guarded.py) fills the records; this module only reads them, so a report can be checked on
records made by hand (tests/guard/test_guarded_demo.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from telemetry.admission.refusal import EXCEEDS_MEMORY_AT_BEST
from telemetry.catalogue.fields import GUARD_WOULD_NOT_FIT
from telemetry.catalogue.metrics import FORECAST_MAX_PREFILL_TOKENS, GUARD_LIMIT_TOKENS

REPORT_FILE = "guard-report.md"
SUMMARY_FILE = "guard-summary.json"
GIB = 1 << 30


@dataclass
class Outcome:
    """One request of a phase: what came back and how long it took."""

    label: str
    tokens: int
    status: int | None  # None: no HTTP answer (connection refused or broken)
    seconds: float
    error_type: str | None = None
    message: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)  # a guard refusal's own fields

    def answer(self) -> str:
        if self.status is None:
            return f"no answer: {self.message}"
        if self.status == 200:
            return "200 OK"
        return f"{self.status} {self.error_type or ''}".strip()


@dataclass
class Burst:
    """What happened around a burst phase's prompts: the other tenant, and (guarded) what the guard did meanwhile."""

    tokens: int  # each prompt's
    fraction: float  # of the node's limit at rest (`tokens`)
    queue_s: float | None = None  # the guard's --queue-s (guarded)
    tenant_bytes: int = 0  # what the other tenant held while the burst was sent
    tenant_held_s: float | None = None  # from its taking the memory to its giving it back (guarded)
    limit_with_tenant: int | None = None  # the guard's limit while the tenant held it
    queued: int = 0  # the guard's queue depth once every prompt of the burst had arrived
    forwarded_while_held: int | None = None  # prompt tokens the node took while the tenant held its memory
    max_in_prefill_tokens: int | None = None  # the most the guard had in prefill at once after the tenant left
    queue_admitted: int | None = None  # the guard's queue outcomes "admitted"
    guard_rejected: int | None = None  # requests the guard answered itself (503s)


@dataclass
class Phase:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    node_alive_after: bool = True
    node_log_lines: list[str] = field(default_factory=list)  # the node's out-of-memory lines, if any
    node_health_after: int | None = None  # the node's /health status after the last request (None: no answer)
    limit_tokens: int | None = None  # the guard's limit before the prompts (guarded phase)
    burst: Burst | None = None  # the burst phases'


def seconds_text(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _find(phase: Phase, label: str) -> Outcome:
    return next(o for o in phase.outcomes if o.label == label)


def _phase(phases: list[Phase], name: str) -> Phase:
    return next(p for p in phases if p.name == name)


def _burst(phase: Phase) -> Burst:
    assert phase.burst is not None, f"{phase.name} is not a burst phase"
    return phase.burst


def _out_of_memory(phase: Phase) -> bool:
    return any("NV_ERR_NO_MEMORY" in line for line in phase.node_log_lines)


def verdict(phases: list[Phase]) -> dict[str, Any]:
    """What the run showed, as facts a reader (and the demo's exit status) can check."""
    unguarded, guarded = _phase(phases, "unguarded"), _phase(phases, "guarded")
    burst_u, burst_g = _phase(phases, "burst unguarded"), _phase(phases, "burst guarded")
    big_u, next_u = _find(unguarded, "1M"), _find(unguarded, "next 32k")
    big_g, next_g = _find(guarded, "1M"), _find(guarded, "next 32k")
    held = _burst(burst_g)
    waits = [o.seconds for o in burst_g.outcomes]
    return {
        "unguarded_1m_failed": big_u.status != 200,
        "unguarded_next_served": next_u.status == 200,
        "unguarded_node_alive_after": unguarded.node_alive_after,
        # Refused before the node saw it: for now (503), or for good once the guard knows what the node takes at best
        # (400, telemetry/admission/at_best.py): which one depends on whether it has read the rank between prefills.
        "guarded_1m_refused": (big_g.status == 503 and big_g.error_type == GUARD_WOULD_NOT_FIT)
        or (big_g.status == 400 and big_g.fields.get("reason") == EXCEEDS_MEMORY_AT_BEST),
        "guarded_1m_refusal_ms": round(big_g.seconds * 1000, 1),
        "guarded_next_served": next_g.status == 200,
        "guarded_node_alive_after": guarded.node_alive_after and guarded.node_health_after == 200,
        "guarded_small_prompts_served": all(o.status == 200 for o in guarded.outcomes if o.label in ("32k", "100k")),
        "burst_prompts": len(burst_g.outcomes),
        "burst_tokens": held.tokens,
        "burst_unguarded_failed": sum(o.status != 200 for o in burst_u.outcomes),
        "burst_unguarded_out_of_memory": _out_of_memory(burst_u),
        "burst_unguarded_node_alive_after": burst_u.node_alive_after and burst_u.node_health_after == 200,
        "burst_guarded_served": sum(o.status == 200 for o in burst_g.outcomes),
        "burst_guarded_queued": held.queued,
        "burst_guarded_forwarded_while_held": held.forwarded_while_held,
        "burst_guarded_one_at_a_time": held.max_in_prefill_tokens is not None
        and 0 < held.max_in_prefill_tokens <= held.tokens,
        "burst_guarded_out_of_memory": _out_of_memory(burst_g),
        "burst_guarded_node_alive_after": burst_g.node_alive_after and burst_g.node_health_after == 200,
        "burst_guarded_fastest_s": round(min(waits), 2) if waits else None,
        "burst_guarded_slowest_s": round(max(waits), 2) if waits else None,
    }


def shown_as_expected(facts: dict[str, Any]) -> bool:
    shown_1m = (facts["unguarded_1m_failed"] and not facts["unguarded_next_served"] and facts["guarded_1m_refused"]
                and facts["guarded_next_served"] and facts["guarded_node_alive_after"]
                and facts["guarded_small_prompts_served"])
    count = facts["burst_prompts"]
    shown_burst = (facts["burst_unguarded_failed"] >= 1 and facts["burst_unguarded_out_of_memory"]
                   and count >= 2 and facts["burst_guarded_served"] == count
                   and facts["burst_guarded_queued"] == count and facts["burst_guarded_forwarded_while_held"] == 0
                   and facts["burst_guarded_one_at_a_time"] and not facts["burst_guarded_out_of_memory"]
                   and facts["burst_guarded_node_alive_after"])
    return bool(shown_1m and shown_burst)


def report_text(phases: list[Phase], capacity_gb: float) -> str:
    facts = verdict(phases)
    unguarded, guarded = _phase(phases, "unguarded"), _phase(phases, "guarded")
    big_u, next_u = _find(unguarded, "1M"), _find(unguarded, "next 32k")
    big_g, next_g = _find(guarded, "1M"), _find(guarded, "next 32k")
    lines = [
        "# memtel guard on a small lab node",
        "",
        f"A lab node with {capacity_gb:g} GiB of emulated unified memory (`memtel lab serve --capacity-gb "
        f"{capacity_gb:g}`, one rank, stock logits width, the hook's live forecast on) takes a 32k-token prompt, a "
        "100k-token prompt, a 1M-token prompt and, a second later, another 32k-token prompt: first straight to the "
        "node, then through `memtel guard` (docs/guard.md) on a fresh node. Then a burst of long prompts while "
        "another tenant holds part of the node's memory, straight to a fresh node, then through a guard with "
        "`--queue-s` to another.",
        "",
        "| phase | request | tokens | answer | time |",
        "| --- | --- | ---: | --- | ---: |",
    ]
    for phase in phases:
        for o in phase.outcomes:
            lines.append(f"| {phase.name} | {o.label} | {o.tokens:,} | {o.answer()} | {seconds_text(o.seconds)} |")
    lines += ["", "## Unguarded", ""]
    if facts["unguarded_1m_failed"]:
        lines.append(f"The 1M-token request failed with {big_u.answer()} after {seconds_text(big_u.seconds)}: its "
                     "prefill ran out of the node's memory and the engine died, as vLLM's engine core does.")
    else:
        lines.append(f"The 1M-token request was served ({seconds_text(big_u.seconds)}): the node was large enough "
                     "(choose a smaller --capacity-gb to show the harm).")
    if unguarded.node_log_lines:
        lines += ["", "The node's log:", ""]
        lines += [f"    {line[:400]}" for line in unguarded.node_log_lines]
    lines.append("")
    lines.append(f"The next request, a second later: {next_u.answer()} after {seconds_text(next_u.seconds)}. After it, "
                 f"{_health(unguarded.node_health_after)}"
                 + ("" if unguarded.node_health_after == 200 else
                    "; every request fails until someone restarts the engine") + ".")
    lines += ["", "## Guarded", ""]
    if guarded.limit_tokens is not None:
        lines.append(f"Before the prompts the guard's limit was {guarded.limit_tokens:,} tokens "
                     f"({GUARD_LIMIT_TOKENS.series}: the rank's {FORECAST_MAX_PREFILL_TOKENS.series}).")
    if facts["guarded_1m_refused"]:
        f = big_g.fields
        lines.append(f"The 1M-token request got its {big_g.status} in {seconds_text(big_g.seconds)} (including sending "
                     "the "
                     f"{big_g.tokens:,}-word prompt over loopback): `{big_g.error_type}`, the prompt's "
                     f"{f.get('prompt_tokens', 0):,} tokens (counted by {f.get('prompt_tokens_counted_by')}) "
                     f"against a limit of {f.get('limit_tokens', 0):,} set by rank {f.get('rank')} on node "
                     f"{f.get('node')}"
                     + (f", whose fit budget was {f.get('fit_budget_bytes') or 0:,} bytes" if big_g.status == 503 else
                        f", at best {f.get('limit_tokens_at_best') or 0:,} (with an empty cache: no retry helps)")
                     + ". The node never saw it.")
    else:
        lines.append(f"The 1M-token request was not refused: {big_g.answer()} ({big_g.message}).")
    lines.append(f"The next request: {next_g.answer()} in {seconds_text(next_g.seconds)}; the node "
                 + ("kept serving" if guarded.node_health_after == 200 else "was down")
                 + f" (/health: {guarded.node_health_after}).")
    lines += _burst_text(phases, facts, capacity_gb)
    lines += ["", "Shown as expected: " + ("yes" if shown_as_expected(facts) else "no") + ".", ""]
    return "\n".join(lines)


def _health(status: int | None) -> str:
    return {None: "nothing answered: the server had exited", 503: "/health answered 503: the engine is dead",
            200: "/health answered 200"}.get(status, f"/health answered {status}")


def _burst_text(phases: list[Phase], facts: dict[str, Any], capacity_gb: float) -> list[str]:
    burst_u, burst_g = _phase(phases, "burst unguarded"), _phase(phases, "burst guarded")
    unheld, held = _burst(burst_u), _burst(burst_g)
    count, limit = len(burst_g.outcomes), _phase(phases, "guarded").limit_tokens or 0
    lines = ["", "## A burst while another tenant holds memory", "",
             f"On a DGX Spark another process (a second engine starting, a job) takes the engine's headroom and gives "
             f"it back when it ends. Here another tenant of the node (`POST /lab/tenant`) takes "
             f"{unheld.tenant_bytes / GIB:.2f} of its {capacity_gb:g} GiB, and {count} prompts of {unheld.tokens:,} "
             f"tokens ({unheld.fraction:g} x the node's limit at rest, {limit:,}: each fits alone once the tenant is "
             "gone, two do not fit beside each other) are sent at once.", "",
             f"**Unguarded** (a fresh node): {facts['burst_unguarded_failed']} of {len(burst_u.outcomes)} failed"]
    if facts["burst_unguarded_out_of_memory"]:
        others = "the other" if len(burst_u.outcomes) == 2 else "the others"
        lines[-1] += (f": the first prefill ran out of the node's memory, the engine died and {others} failed with "
                      f"it. After them, {_health(burst_u.node_health_after)}. The node's log:")
        lines += [""] + [f"    {line[:400]}" for line in burst_u.node_log_lines] + [""]
    else:
        lines[-1] += " (no prefill ran out of memory: choose a larger tenant to show the harm)."
        lines.append("")
    slow, fast = facts["burst_guarded_slowest_s"], facts["burst_guarded_fastest_s"]
    lines.append(
        f"**Guarded** (another fresh node, a guard with `--queue-s {held.queue_s or 0:g}`): with the tenant's "
        f"{held.tenant_bytes / GIB:.2f} GiB held, the guard's limit was {held.limit_with_tenant or 0:,} tokens. "
        f"{held.queued} of {count} waited in its queue and {held.forwarded_while_held or 0:,} prompt tokens reached "
        f"the node while the tenant held its memory. The tenant gave it back after {held.tenant_held_s or 0:.1f} s; "
        f"the guard then admitted them one at a time (at most {held.max_in_prefill_tokens or 0:,} tokens in prefill "
        f"at once) and {facts['burst_guarded_served']} of {count} completed, in {fast} to {slow} s from their "
        f"sending (queue outcomes admitted: {held.queue_admitted}; answered by the guard itself: "
        f"{held.guard_rejected}). The node logged "
        + ("an out-of-memory line." if facts["burst_guarded_out_of_memory"] else "no NV_ERR_NO_MEMORY line")
        + f" and kept serving (/health: {burst_g.node_health_after}).")
    return lines


def write_report(out: Path, phases: list[Phase], capacity_gb: float) -> Path:
    path = out / REPORT_FILE
    path.write_text(report_text(phases, capacity_gb))
    summary = {"capacity_gb": capacity_gb, "phases": [asdict(phase) for phase in phases], "facts": verdict(phases)}
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return path


__all__ = ["REPORT_FILE", "SUMMARY_FILE", "Burst", "Outcome", "Phase", "report_text", "seconds_text",
           "shown_as_expected", "verdict", "write_report"]
