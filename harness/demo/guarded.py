"""`memtel demo --guard`: a small lab node takes 32k and 100k prompts, then a 1M-token one; without and with the guard.

    memtel demo --guard [--out DIR] [--capacity-gb X]

Two phases on a fresh lab node each (`memtel lab serve --capacity-gb X`, sim allocator, one rank, the
hook's live forecast on; the profile in configs/ladders/guarded-small-node.yaml):

1. unguarded: the prompts go straight to the node. The 1M-token prefill runs out of the node's memory:
   the request fails, the engine dies, and the next request finds no server;
2. guarded: the same prompts go through `memtel guard`, which reads the rank's
   memtel_forecast_max_prefill_tokens. The 1M-token request gets its 503 in milliseconds, the node never
   sees it, and the next request is served.

It writes guard-report.md (both phases, with the numbers) and guard-summary.json into the run directory,
and prints the gist. Every process it starts is stopped on the way out, also on Ctrl-C.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness.ports import free_port_block
from harness.processes import die_with_parent, wait_healthy
from telemetry.catalogue.fields import GUARD_WOULD_NOT_FIT
from telemetry.catalogue.metrics import FORECAST_MAX_PREFILL_TOKENS, GUARD_LIMIT_TOKENS
from telemetry.errors import RunError
from telemetry.scrape import METRICS_PATH, Endpoint, FetchError, read_metrics

DEFAULT_CAPACITY_GB = 1.5
# The node's shape: 4 indexer layers and a logits budget too large to split a launch, so the stock width's
# logits grow with the context (a 1M-token prefill asks for ~0.8 GiB in one launch); host pages are not
# touched (the capacity is the emulated memory), so the demo takes seconds.
NODE_ARGS = ("--arm", "stock", "--ranks", "1", "--allocator", "sim", "--layers", "4", "--chunk", "8192",
             "--max-model-len", "1100000", "--budget-mb", "100000", "--scale", "0.25", "--no-unified-memory")
FORECAST_ENV = {"MEMTEL_FORECAST_TOKENS": "32768,100000,1048576", "MEMTEL_FORECAST_INTERVAL_S": "1"}
PROMPTS = (("32k", 32_768), ("100k", 100_000), ("1M", 1_048_576), ("next 32k", 32_768))
MAX_TOKENS = 4
REPORT_FILE = "guard-report.md"
SUMMARY_FILE = "guard-summary.json"


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
class Phase:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    node_alive_after: bool = True
    node_log_lines: list[str] = field(default_factory=list)  # the node's out-of-memory lines, if any
    node_health_after: int | None = None  # the node's /health status after the last request (None: no answer)
    limit_tokens: int | None = None  # the guard's limit before the prompts (guarded phase)


_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def prompt_text(tokens: int, seed: int) -> str:
    """`tokens` words of about 4 bytes (the lab's tokenizer: one word, one token; real text runs about 4 bytes
    a token), whose first letters differ by `seed`, so no two prompts share a cached block."""
    lead = _DIGITS[seed % 36]
    words = [lead + _DIGITS[i // 36] + _DIGITS[i % 36] for i in range(36 * 36)]
    return " ".join(words[i % len(words)] for i in range(tokens))


def post_completion(base_url: str, tokens: int, seed: int, timeout_s: float = 600.0) -> Outcome:
    parts = urllib.parse.urlsplit(base_url)
    body = json.dumps({"model": "lab", "prompt": prompt_text(tokens, seed), "max_tokens": MAX_TOKENS}).encode()
    started = time.perf_counter()
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
    except OSError as exc:
        return Outcome("", tokens, None, time.perf_counter() - started, message=exc.strerror or type(exc).__name__)
    finally:
        conn.close()
    seconds = time.perf_counter() - started
    if response.status == 200:
        return Outcome("", tokens, 200, seconds)
    try:
        error = json.loads(data).get("error") or {}
    except (ValueError, AttributeError):
        error = {}
    known = ("message", "type", "param", "code")
    return Outcome("", tokens, response.status, seconds, error.get("type"), str(error.get("message", ""))[:300],
                   {k: v for k, v in error.items() if k not in known})


class Process:
    """A child in its own session, stopped (TERM, then KILL) on the way out."""

    def __init__(self, command: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        import os

        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, preexec_fn=die_with_parent,
                                            env={**os.environ, **(env or {})})

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float = 15.0) -> None:
        import os

        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(grace_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:  # the lab's ranks share its group: none may remain
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


def start_node(port: int, memtel_port: int, capacity_gb: float, log_path: Path, time_scale: float = 0.01) -> Process:
    command = [sys.executable, "-m", "telemetry", "lab", "serve", *NODE_ARGS, "--capacity-gb", repr(capacity_gb),
               "--time-scale", repr(time_scale), "--host", "127.0.0.1", "--port", str(port), "--memtel-port",
               str(memtel_port), "--model-name", "lab"]
    node = Process(command, log_path, FORECAST_ENV)
    wait_healthy(f"http://127.0.0.1:{port}/health", node.process, timeout_s=120, log_path=log_path,
                 what="the lab node", error=RunError, interval_s=0.2)
    return node


def start_guard(port: int, upstream_port: int, hooks: list[str], metrics_port: int, log_path: Path,
                *extra: str) -> Process:
    command = [sys.executable, "-m", "telemetry", "guard", "--upstream", f"http://127.0.0.1:{upstream_port}",
               "--listen", f"127.0.0.1:{port}", "--hooks", ",".join(hooks), "--metrics-listen",
               f"127.0.0.1:{metrics_port}", *extra]
    guard = Process(command, log_path)
    wait_healthy(f"http://127.0.0.1:{metrics_port}/metrics", guard.process, timeout_s=60, log_path=log_path,
                 what="the guard", error=RunError, interval_s=0.1)
    return guard


MAX_GUARD_METRICS_BYTES = 1 << 20  # the guard's own /metrics is a few kB


def guard_limit(metrics_port: int) -> int | None:
    """The guard's limit (GUARD_LIMIT_TOKENS) now, or None (blind, or no answer)."""
    try:
        exposition = read_metrics(Endpoint("http", "127.0.0.1", metrics_port, METRICS_PATH), time.monotonic() + 2,
                                  MAX_GUARD_METRICS_BYTES, only=[GUARD_LIMIT_TOKENS])
    except FetchError:
        return None
    limit = exposition.first(GUARD_LIMIT_TOKENS)
    return None if limit is None else int(limit)


def wait_for_limit(metrics_port: int, guard: Process, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        limit = guard_limit(metrics_port)
        if limit is not None:
            return limit
        if not guard.alive():
            raise RunError(f"the guard exited; log {guard.log_path}")
        time.sleep(0.2)
    raise RunError(f"the guard saw no {FORECAST_MAX_PREFILL_TOKENS.series} from the node's hook within "
                   f"{timeout_s:.0f} s (is the hook's live forecast running? see {guard.log_path})")


def out_of_memory_lines(log_path: Path) -> list[str]:
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line for line in lines if "NV_ERR_NO_MEMORY" in line or "engine dead" in line][:3]


def run_phase(name: str, base_url: str, node: Process, node_log: Path, node_url: str) -> Phase:
    phase = Phase(name)
    for seed, (label, tokens) in enumerate(PROMPTS, start=1):
        if label.startswith("next"):
            time.sleep(1.0)  # what a client retrying after a second finds
        outcome = post_completion(base_url, tokens, seed)
        outcome.label = label
        phase.outcomes.append(outcome)
        print(f"  {name}: {label:>8} ({tokens:>9,} tokens): {outcome.answer()} in {_seconds(outcome.seconds)}",
              flush=True)
    phase.node_health_after = health_status(node_url)
    phase.node_alive_after = node.alive()
    phase.node_log_lines = out_of_memory_lines(node_log)
    return phase


def health_status(node_url: str) -> int | None:
    parts = urllib.parse.urlsplit(node_url)
    try:
        conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=5)
        conn.request("GET", "/health")
        status = conn.getresponse().status
        conn.close()
    except OSError:
        return None
    return status


def run_guarded_demo(out: Path, capacity_gb: float = DEFAULT_CAPACITY_GB) -> tuple[Phase, Phase]:
    out.mkdir(parents=True, exist_ok=True)
    base = free_port_block(5)
    node_port, hook_port, guard_port, metrics_port = base, base + 1, base + 3, base + 4
    logs = out / "logs"
    print(f"memtel demo --guard: a lab node of {capacity_gb:g} GiB; run directory {out}", flush=True)
    phases = []
    for name in ("unguarded", "guarded"):
        node_log = logs / f"node-{name}.log"
        node = start_node(node_port, hook_port, capacity_gb, node_log)
        guard = None
        try:
            url = f"http://127.0.0.1:{node_port}"
            limit = None
            if name == "guarded":
                guard = start_guard(guard_port, node_port, [f"http://127.0.0.1:{hook_port}"], metrics_port,
                                    logs / "guard.log")
                limit = wait_for_limit(metrics_port, guard)
                url = f"http://127.0.0.1:{guard_port}"
            phase = run_phase(name, url, node, node_log, f"http://127.0.0.1:{node_port}")
            phase.limit_tokens = limit
            phases.append(phase)
        finally:
            if guard is not None:
                guard.stop()
            node.stop()
    return phases[0], phases[1]


# --- the report ----------------------------------------------------------------------------------


def _seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _find(phase: Phase, label: str) -> Outcome:
    return next(o for o in phase.outcomes if o.label == label)


def verdict(unguarded: Phase, guarded: Phase) -> dict[str, Any]:
    """What the run showed, as facts a reader (and the demo's exit status) can check."""
    big_u, next_u = _find(unguarded, "1M"), _find(unguarded, "next 32k")
    big_g, next_g = _find(guarded, "1M"), _find(guarded, "next 32k")
    return {
        "unguarded_1m_failed": big_u.status != 200,
        "unguarded_next_served": next_u.status == 200,
        "unguarded_node_alive_after": unguarded.node_alive_after,
        "guarded_1m_refused": big_g.status == 503 and big_g.error_type == GUARD_WOULD_NOT_FIT,
        "guarded_1m_refusal_ms": round(big_g.seconds * 1000, 1),
        "guarded_next_served": next_g.status == 200,
        "guarded_node_alive_after": guarded.node_alive_after and guarded.node_health_after == 200,
        "guarded_small_prompts_served": all(o.status == 200 for o in guarded.outcomes if o.label in ("32k", "100k")),
    }


def shown_as_expected(facts: dict[str, Any]) -> bool:
    return bool(facts["unguarded_1m_failed"] and not facts["unguarded_next_served"] and facts["guarded_1m_refused"]
                and facts["guarded_next_served"] and facts["guarded_node_alive_after"]
                and facts["guarded_small_prompts_served"])


def report_text(unguarded: Phase, guarded: Phase, capacity_gb: float) -> str:
    facts = verdict(unguarded, guarded)
    big_u, next_u = _find(unguarded, "1M"), _find(unguarded, "next 32k")
    big_g, next_g = _find(guarded, "1M"), _find(guarded, "next 32k")
    lines = [
        "# memtel guard on a small lab node",
        "",
        f"A lab node with {capacity_gb:g} GiB of emulated unified memory (`memtel lab serve --capacity-gb "
        f"{capacity_gb:g}`, one rank, stock logits width, the hook's live forecast on) takes a 32k-token prompt, a "
        "100k-token prompt, a 1M-token prompt and, a second later, another 32k-token prompt: first straight to the "
        "node, then through `memtel guard` (docs/guard.md) on a fresh node.",
        "",
        "| phase | request | tokens | answer | time |",
        "| --- | --- | ---: | --- | ---: |",
    ]
    for phase in (unguarded, guarded):
        for o in phase.outcomes:
            lines.append(f"| {phase.name} | {o.label} | {o.tokens:,} | {o.answer()} | {_seconds(o.seconds)} |")
    lines += ["", "## Unguarded", ""]
    if facts["unguarded_1m_failed"]:
        lines.append(f"The 1M-token request failed with {big_u.answer()} after {_seconds(big_u.seconds)}: its "
                     "prefill ran out of the node's memory and the engine died, as vLLM's engine core does.")
    else:
        lines.append(f"The 1M-token request was served ({_seconds(big_u.seconds)}): the node was large enough "
                     "(choose a smaller --capacity-gb to show the harm).")
    if unguarded.node_log_lines:
        lines += ["", "The node's log:", ""]
        lines += [f"    {line[:400]}" for line in unguarded.node_log_lines]
    lines.append("")
    after = {None: "nothing answered: the server had exited", 503: "/health answered 503: the engine is dead",
             200: "/health answered 200"}
    lines.append(f"The next request, a second later: {next_u.answer()} after {_seconds(next_u.seconds)}. After it, "
                 f"{after.get(unguarded.node_health_after, f'/health answered {unguarded.node_health_after}')}"
                 + ("" if unguarded.node_health_after == 200 else
                    "; every request fails until someone restarts the engine") + ".")
    lines += ["", "## Guarded", ""]
    if guarded.limit_tokens is not None:
        lines.append(f"Before the prompts the guard's limit was {guarded.limit_tokens:,} tokens "
                     f"({GUARD_LIMIT_TOKENS.series}: the rank's {FORECAST_MAX_PREFILL_TOKENS.series}).")
    if facts["guarded_1m_refused"]:
        f = big_g.fields
        lines.append(f"The 1M-token request got its 503 in {_seconds(big_g.seconds)} (including sending the "
                     f"{big_g.tokens:,}-word prompt over loopback): `{big_g.error_type}`, the prompt's "
                     f"{f.get('prompt_tokens', 0):,} tokens (counted by {f.get('prompt_tokens_counted_by')}) "
                     f"against a limit of {f.get('limit_tokens', 0):,} set by rank {f.get('rank')} on node "
                     f"{f.get('node')}, whose fit budget was {f.get('fit_budget_bytes') or 0:,} bytes. The node never "
                     "saw it.")
    else:
        lines.append(f"The 1M-token request was not refused: {big_g.answer()} ({big_g.message}).")
    lines.append(f"The next request: {next_g.answer()} in {_seconds(next_g.seconds)}; the node "
                 + ("kept serving" if guarded.node_health_after == 200 else "was down")
                 + f" (/health: {guarded.node_health_after}).")
    lines += ["", "Shown as expected: " + ("yes" if shown_as_expected(facts) else "no") + ".", ""]
    return "\n".join(lines)


def write_report(out: Path, unguarded: Phase, guarded: Phase, capacity_gb: float) -> Path:
    path = out / REPORT_FILE
    path.write_text(report_text(unguarded, guarded, capacity_gb))
    summary = {"capacity_gb": capacity_gb, "phases": [asdict(unguarded), asdict(guarded)],
               "facts": verdict(unguarded, guarded)}
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return path


def run(out: Path, capacity_gb: float = DEFAULT_CAPACITY_GB) -> int:
    """The `memtel demo --guard` command: 0 when both phases showed what they should, 1 otherwise."""
    started = time.monotonic()

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous_sigterm = signal.signal(signal.SIGTERM, interrupt)  # SIGTERM stops it as Ctrl-C does
    try:
        unguarded, guarded = run_guarded_demo(out, capacity_gb)
    except KeyboardInterrupt:
        print("\nmemtel demo --guard: interrupted; every process it started has been stopped", file=sys.stderr)
        return 130
    except RunError as exc:
        print(f"\nmemtel demo --guard: error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
    path = write_report(out, unguarded, guarded, capacity_gb)
    facts = verdict(unguarded, guarded)
    print(f"memtel demo --guard: done in {time.monotonic() - started:.0f} s. Report: {path}", flush=True)
    if not shown_as_expected(facts):
        print(f"memtel demo --guard: error: the run did not show the guard's effect as expected: {facts}",
              file=sys.stderr)
        return 1
    return 0


__all__ = ["DEFAULT_CAPACITY_GB", "NODE_ARGS", "PROMPTS", "Outcome", "Phase", "post_completion", "report_text",
           "run", "run_guarded_demo", "start_guard", "start_node", "verdict"]
