"""`memtel demo --guard`: a small lab node takes 32k and 100k prompts, then a 1M-token one; without and with the guard;
then a burst of long prompts while another tenant holds part of the node's memory, without and with the guard's queue.

    memtel demo --guard [--out DIR] [--capacity-gb X]

Lab nodes of X GiB (`memtel lab serve --capacity-gb X`, sim allocator, one rank, the hook's live forecast on; the
profile in configs/ladders/guarded-small-node.yaml):

1. unguarded: the prompts go straight to a fresh node. The 1M-token prefill runs out of the node's memory:
   the request fails, the engine dies, and the next request finds no server;
2. guarded: the same prompts go through `memtel guard` to a fresh node; the guard reads the rank's
   memtel_forecast_max_prefill_tokens and its at-best. The 1M-token request gets a permanent 400 in
   milliseconds (more than the rank could take with its cache released), the node never sees it, and the next
   request is served;
3. burst unguarded: another tenant (a second engine starting, a job: `POST /lab/tenant`) takes part of a fresh
   node's memory, and two prompts of 0.6 x the node's limit at rest (each fits alone once the tenant is
   gone) go straight to it at once: the first prefill runs out of memory, the engine dies, the other fails;
4. burst guarded (at the same time as 3): the same on another fresh node, through a guard with --queue-s: none
   is forwarded while the tenant holds its memory; once it gives it back they are admitted one at a time (two
   do not fit together: the guard's in-prefill holds) and both complete, later.

It writes guard-report.md (every phase, with the numbers) and guard-summary.json into the run directory
(guard_report.py), and prints the gist. Every process it starts is stopped on the way out, also on Ctrl-C.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from harness.demo.guard_report import GIB, Burst, Outcome, Phase, seconds_text, shown_as_expected, verdict, write_report
from harness.ports import free_port_block
from harness.processes import die_with_parent, wait_healthy
from telemetry import hook_env
from telemetry.catalogue import vllm
from telemetry.catalogue.metrics import (
    FORECAST_MAX_PREFILL_TOKENS,
    GUARD_IN_PREFILL_TOKENS,
    GUARD_LIMIT_TOKENS,
    GUARD_QUEUE_DEPTH,
    GUARD_QUEUE_OUTCOMES,
    GUARD_REJECTED,
)
from telemetry.errors import RunError
from telemetry.scrape import Exposition, FetchError, read_metrics
from telemetry.url import METRICS_PATH, Endpoint, parse_base_url

DEFAULT_CAPACITY_GB = 1.5
# The node's shape: 4 indexer layers and a logits budget too large to split a launch, so the stock width's
# logits grow with the context (a 1M-token prefill asks for ~0.8 GiB in one launch); host pages are not
# touched (the capacity is the emulated memory), so the demo takes seconds.
NODE_ARGS = ("--arm", "stock", "--ranks", "1", "--allocator", "sim", "--layers", "4", "--chunk", "8192",
             "--max-model-len", "1100000", "--budget-mb", "100000", "--scale", "0.25", "--no-unified-memory")
FORECAST_ENV = {hook_env.FORECAST_TOKENS: "32768,100000,1048576", hook_env.FORECAST_INTERVAL_S: "1"}
PROMPTS = (("32k", 32_768), ("100k", 100_000), ("1M", 1_048_576), ("next 32k", 32_768))
MAX_TOKENS = 4
# The burst while another tenant holds memory (phases 3 and 4).
BURST_PROMPTS = 2
BURST_FRACTION = 0.6  # of the node's limit at rest: each prompt fits alone, two do not fit beside each other
TENANT_FRACTION = 0.6  # of the node's memory, taken by the other tenant: then none of the burst fits
QUEUE_S = 60.0  # the second guard's --queue-s: far longer than the tenant holds its memory


_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def prompt_text(tokens: int, seed: int) -> str:
    """`tokens` words of about 4 bytes (the lab's tokenizer: one word, one token; real text runs about 4 bytes
    a token), whose first letters differ by `seed`, so no two prompts share a cached block."""
    lead = _DIGITS[seed % 36]
    words = [lead + _DIGITS[i // 36] + _DIGITS[i % 36] for i in range(36 * 36)]
    return " ".join(words[i % len(words)] for i in range(tokens))


def _connection(base_url: str, timeout_s: float) -> http.client.HTTPConnection:
    """A connection to the server at `base_url` (the demo's own `http://127.0.0.1:PORT`)."""
    endpoint = parse_base_url(base_url)
    return http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=timeout_s)


def post_completion(base_url: str, tokens: int, seed: int, timeout_s: float = 600.0) -> Outcome:
    body = json.dumps({"model": "lab", "prompt": prompt_text(tokens, seed), "max_tokens": MAX_TOKENS}).encode()
    started = time.perf_counter()
    conn = _connection(base_url, timeout_s)
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


def launch_node(port: int, memtel_port: int, capacity_gb: float, log_path: Path, time_scale: float = 0.01) -> Process:
    """A lab node starting (wait_node waits for it)."""
    command = [sys.executable, "-m", "telemetry", "lab", "serve", *NODE_ARGS, "--capacity-gb", repr(capacity_gb),
               "--time-scale", repr(time_scale), "--listen", f"127.0.0.1:{port}", "--hook-listen",
               f"127.0.0.1:{memtel_port}", "--model-name", "lab"]
    return Process(command, log_path, FORECAST_ENV)


def wait_node(node: Process, port: int) -> Process:
    wait_healthy(f"http://127.0.0.1:{port}/health", node.process, timeout_s=120, log_path=node.log_path,
                 what="the lab node", error=RunError, interval_s=0.2)
    return node


def start_node(port: int, memtel_port: int, capacity_gb: float, log_path: Path, time_scale: float = 0.01) -> Process:
    return wait_node(launch_node(port, memtel_port, capacity_gb, log_path, time_scale), port)


def launch_guard(port: int, upstream_port: int, hooks: list[str], metrics_port: int, log_path: Path,
                 *extra: str) -> Process:
    """A `memtel guard` starting (wait_guard waits for it)."""
    command = [sys.executable, "-m", "telemetry", "guard", "--upstream", f"http://127.0.0.1:{upstream_port}",
               "--listen", f"127.0.0.1:{port}", "--hooks", ",".join(hooks), "--metrics-listen",
               f"127.0.0.1:{metrics_port}", *extra]
    return Process(command, log_path)


def wait_guard(guard: Process, metrics_port: int) -> Process:
    wait_healthy(f"http://127.0.0.1:{metrics_port}/metrics", guard.process, timeout_s=60, log_path=guard.log_path,
                 what="the guard", error=RunError, interval_s=0.1)
    return guard


def start_guard(port: int, upstream_port: int, hooks: list[str], metrics_port: int, log_path: Path,
                *extra: str) -> Process:
    return wait_guard(launch_guard(port, upstream_port, hooks, metrics_port, log_path, *extra), metrics_port)


MAX_GUARD_METRICS_BYTES = 1 << 20  # a guard's or a lab node's /metrics is a few kB


def scrape(port: int, *entries: Any, timeout_s: float = 5.0) -> Exposition:
    """`entries` of the /metrics on 127.0.0.1:`port` (a guard's, a lab node's); RunError if it cannot be read."""
    try:
        return read_metrics(Endpoint("http", "127.0.0.1", port, METRICS_PATH), time.monotonic() + timeout_s,
                            MAX_GUARD_METRICS_BYTES, only=entries)
    except FetchError as exc:
        raise RunError(f"scraping 127.0.0.1:{port}: {exc}") from None


def guard_limit(metrics_port: int) -> int | None:
    """The guard's limit (GUARD_LIMIT_TOKENS) now, or None (blind, or no answer)."""
    try:
        limit = scrape(metrics_port, GUARD_LIMIT_TOKENS, timeout_s=2).first(GUARD_LIMIT_TOKENS)
    except RunError:
        return None
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


def run_phase(name: str, base_url: str, node: Process, node_url: str) -> Phase:
    phase = Phase(name)
    for seed, (label, tokens) in enumerate(PROMPTS, start=1):
        if label.startswith("next"):
            time.sleep(1.0)  # what a client retrying after a second finds
        outcome = post_completion(base_url, tokens, seed)
        outcome.label = label
        phase.outcomes.append(outcome)
        print(f"  {name}: {label:>8} ({tokens:>9,} tokens): {outcome.answer()} in {seconds_text(outcome.seconds)}",
              flush=True)
    return node_after(phase, node, node_url)


def node_after(phase: Phase, node: Process, node_url: str) -> Phase:
    """`phase` with what its node looked like after its requests: /health, alive, its out-of-memory lines."""
    phase.node_health_after = health_status(node_url)
    phase.node_alive_after = node.alive()
    phase.node_log_lines = out_of_memory_lines(node.log_path)
    return phase


def health_status(node_url: str) -> int | None:
    try:
        conn = _connection(node_url, 5)
        conn.request("GET", "/health")
        status = conn.getresponse().status
        conn.close()
    except OSError:
        return None
    return status


def post_json(url: str, path: str, payload: dict[str, Any]) -> dict[str, Any]:
    conn = _connection(url, 10)
    try:
        conn.request("POST", path, body=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
    except OSError as exc:
        raise RunError(f"POST {url}{path}: {exc.strerror or type(exc).__name__}") from None
    finally:
        conn.close()
    if response.status != 200:
        raise RunError(f"POST {url}{path}: {response.status} {data[:300]!r}")
    answer: dict[str, Any] = json.loads(data)
    return answer


def tenant_holds(node_url: str, gib: float) -> int:
    """Another tenant of the node holds `gib` GiB from now (0: gives them back); the bytes it holds."""
    return int(post_json(node_url, "/lab/tenant", {"gib": gib})["tenant_bytes"])


def poll(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RunError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(0.05)


def send_burst(url: str, tokens: int, seed: int) -> tuple[list[threading.Thread], list[Outcome]]:
    """BURST_PROMPTS prompts of `tokens` at once, each from its own thread; the outcomes fill in as they end."""
    outcomes = [Outcome(f"#{i + 1}", tokens, None, 0.0, message="not sent") for i in range(BURST_PROMPTS)]

    def send(i: int) -> None:
        outcome = post_completion(url, tokens, seed + i)
        outcome.label = outcomes[i].label
        outcomes[i] = outcome

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(BURST_PROMPTS)]
    for thread in threads:
        thread.start()
    return threads, outcomes


def end_burst(phase: Phase, threads: list[threading.Thread], outcomes: list[Outcome], node: Process,
              node_url: str, timeout_s: float = 300.0) -> Phase:
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0))
    phase.outcomes = outcomes
    for outcome in outcomes:
        print(f"  {phase.name}: {outcome.label} ({outcome.tokens:,} tokens): {outcome.answer()} in "
              f"{seconds_text(outcome.seconds)}", flush=True)
    return node_after(phase, node, node_url)


def run_burst_unguarded(node: Process, node_url: str, tokens: int, capacity_gb: float) -> Phase:
    """Phase 3: the tenant takes its part of a fresh node, the burst goes straight to the node."""
    burst = Burst(tokens, BURST_FRACTION)
    phase = Phase("burst unguarded", burst=burst)
    burst.tenant_bytes = tenant_holds(node_url, TENANT_FRACTION * capacity_gb)
    print(f"  {phase.name}: another tenant holds {burst.tenant_bytes / GIB:.2f} of the node's {capacity_gb:g} GiB; "
          f"{BURST_PROMPTS} prompts of {tokens:,} tokens at once, straight to the node", flush=True)
    threads, outcomes = send_burst(node_url, tokens, seed=20)
    return end_burst(phase, threads, outcomes, node, node_url)


def run_burst_guarded(node: Process, node_port: int, guard_port: int, metrics_port: int, tokens: int,
                      capacity_gb: float) -> Phase:
    """Phase 4: the tenant takes its part of a fresh node; the burst goes through the queueing guard, which
    forwards none while the tenant holds its memory; then the tenant gives it back and they are admitted."""
    node_url = f"http://127.0.0.1:{node_port}"
    burst = Burst(tokens, BURST_FRACTION, QUEUE_S)
    phase = Phase("burst guarded", burst=burst)
    taken = time.monotonic()
    burst.tenant_bytes = tenant_holds(node_url, TENANT_FRACTION * capacity_gb)
    poll(lambda: (guard_limit(metrics_port) or tokens) < tokens, 60, "the guard's limit to fall below the burst's "
         "prompts while the other tenant holds its memory")
    burst.limit_with_tenant = guard_limit(metrics_port)
    print(f"  {phase.name}: another tenant holds {burst.tenant_bytes / GIB:.2f} of the node's {capacity_gb:g} GiB; "
          f"the guard's limit is {burst.limit_with_tenant or 0:,} tokens; {BURST_PROMPTS} prompts of {tokens:,} "
          f"tokens at once, through the guard (--queue-s {QUEUE_S:g})", flush=True)
    before = scrape(node_port, vllm.PROMPT_TOKENS).total(vllm.PROMPT_TOKENS) or 0.0
    threads, outcomes = send_burst(f"http://127.0.0.1:{guard_port}", tokens, seed=30)

    def queue_depth() -> int:
        return int(scrape(metrics_port, GUARD_QUEUE_DEPTH).first(GUARD_QUEUE_DEPTH) or 0)

    poll(lambda: queue_depth() >= BURST_PROMPTS or not any(t.is_alive() for t in threads), 60,
         "the burst to arrive in the guard's queue")
    burst.queued = queue_depth()
    burst.forwarded_while_held = int((scrape(node_port, vllm.PROMPT_TOKENS).total(vllm.PROMPT_TOKENS) or 0) - before)
    tenant_holds(node_url, 0)
    burst.tenant_held_s = time.monotonic() - taken
    print(f"  {phase.name}: {burst.queued} waiting in the guard's queue, {burst.forwarded_while_held:,} tokens "
          f"forwarded; the tenant gives its memory back after {burst.tenant_held_s:.1f} s", flush=True)
    most = 0
    while any(thread.is_alive() for thread in threads):
        most = max(most, int(scrape(metrics_port, GUARD_IN_PREFILL_TOKENS).first(GUARD_IN_PREFILL_TOKENS) or 0))
        time.sleep(0.05)
    burst.max_in_prefill_tokens = most
    after = scrape(metrics_port, GUARD_QUEUE_OUTCOMES, GUARD_REJECTED)
    burst.queue_admitted = int(after.total(GUARD_QUEUE_OUTCOMES, outcome="admitted") or 0)
    burst.guard_rejected = int(after.total(GUARD_REJECTED) or 0)
    return end_burst(phase, threads, outcomes, node, node_url)


def run_guarded_demo(out: Path, capacity_gb: float = DEFAULT_CAPACITY_GB) -> list[Phase]:
    out.mkdir(parents=True, exist_ok=True)
    base = free_port_block(11)
    node_port, hook_port, guard_port, metrics_port = base, base + 1, base + 3, base + 4
    # The burst phases' fresh nodes (a node's cache after phases 1 and 2 would leave the tenant little to take) and
    # the queueing guard start with the first node, so they are up when their phases come.
    burst_ports = {"burst unguarded": (base + 5, base + 6), "burst guarded": (base + 7, base + 8)}
    queue_port, queue_metrics = base + 9, base + 10
    logs = out / "logs"
    print(f"memtel demo --guard: lab nodes of {capacity_gb:g} GiB; run directory {out}", flush=True)
    phases: list[Phase] = []
    processes: list[Process] = []
    try:
        burst_nodes = {name: launch_node(port, hook, capacity_gb, logs / f"node-{name.replace(' ', '-')}.log")
                       for name, (port, hook) in burst_ports.items()}
        processes += burst_nodes.values()
        held_port, held_hook = burst_ports["burst guarded"]
        queue_guard = launch_guard(queue_port, held_port, [f"http://127.0.0.1:{held_hook}"], queue_metrics,
                                   logs / "guard-queue.log", "--queue-s", repr(QUEUE_S))
        processes.append(queue_guard)
        node_url = f"http://127.0.0.1:{node_port}"
        node = start_node(node_port, hook_port, capacity_gb, logs / "node-unguarded.log")
        processes.append(node)
        phases.append(run_phase("unguarded", node_url, node, node_url))
        node.stop()

        node = start_node(node_port, hook_port, capacity_gb, logs / "node-guarded.log")
        processes.append(node)
        guard = start_guard(guard_port, node_port, [f"http://127.0.0.1:{hook_port}"], metrics_port,
                            logs / "guard.log")
        processes.append(guard)
        limit = wait_for_limit(metrics_port, guard)
        phase = run_phase("guarded", f"http://127.0.0.1:{guard_port}", node, node_url)
        phase.limit_tokens = limit
        phases.append(phase)
        guard.stop()
        node.stop()

        tokens = int(limit * BURST_FRACTION)  # a fresh node's limit at rest: each fits alone, two do not
        for name, burst_node in burst_nodes.items():
            wait_node(burst_node, burst_ports[name][0])
        wait_guard(queue_guard, queue_metrics)
        wait_for_limit(queue_metrics, queue_guard)
        # Phases 3 and 4 run at once, on their own nodes: phase 3 is over in seconds, phase 4 waits for the tenant.
        unguarded: list[Phase | BaseException] = []

        def burst_unguarded() -> None:
            try:
                unguarded.append(run_burst_unguarded(burst_nodes["burst unguarded"],
                                                     f"http://127.0.0.1:{burst_ports['burst unguarded'][0]}", tokens,
                                                     capacity_gb))
            except BaseException as error:   # raised again below, in the demo's own thread
                unguarded.append(error)

        other = threading.Thread(target=burst_unguarded, name="burst-unguarded", daemon=True)
        other.start()
        guarded = run_burst_guarded(burst_nodes["burst guarded"], held_port, queue_port, queue_metrics, tokens,
                                    capacity_gb)
        other.join(600)
        if not unguarded:
            raise RunError("the unguarded burst did not end within 600 s")
        if isinstance(unguarded[0], BaseException):
            raise unguarded[0]
        phases += [unguarded[0], guarded]
    finally:
        for process in reversed(processes):
            process.stop()
    return phases


def run(out: Path, capacity_gb: float = DEFAULT_CAPACITY_GB) -> int:
    """The `memtel demo --guard` command: 0 when both phases showed what they should, 1 otherwise."""
    started = time.monotonic()

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous_sigterm = signal.signal(signal.SIGTERM, interrupt)  # SIGTERM stops it as Ctrl-C does
    try:
        phases = run_guarded_demo(out, capacity_gb)
    except KeyboardInterrupt:
        print("\nmemtel demo --guard: interrupted; every process it started has been stopped", file=sys.stderr)
        return 130
    except RunError as exc:
        print(f"\nmemtel demo --guard: error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
    path = write_report(out, phases, capacity_gb)
    facts = verdict(phases)
    print(f"memtel demo --guard: done in {time.monotonic() - started:.0f} s. Report: {path}", flush=True)
    if not shown_as_expected(facts):
        print(f"memtel demo --guard: error: the run did not show the guard's effect as expected: {facts}",
              file=sys.stderr)
        return 1
    return 0


__all__ = ["BURST_PROMPTS", "DEFAULT_CAPACITY_GB", "FORECAST_ENV", "NODE_ARGS", "PROMPTS", "Process", "guard_limit",
           "post_completion", "prompt_text", "run", "run_guarded_demo", "start_guard", "start_node", "tenant_holds"]
