"""Writes the synthetic timelines of tests/fixtures/alerts/corpus/ (docs/alerts.md, "The corpus").

    .venv/bin/python -m tests.alerts.make_corpus [--out tests/fixtures/alerts/corpus]

Each timeline models a node second by second: MemTotal, MemAvailable, free memory in blocks of at least
2 MiB, the huge-page fault counters, PSI, the kernel-log counters and the collectors' health. The headroom
series are computed by the daemon's own code (telemetry.procfs.headroom) from those inputs, so the corpus
says what the daemon would have exported. The shapes come from the reports quoted in issue 20; the live
recording made on this machine (page-cache-churn-live.jsonl) is written by `memtel alerts burn-in`, not here.
Deterministic: tests/alerts/test_corpus.py checks the shipped files equal what this writes.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from telemetry.procfs.headroom import FaultWindow, headroom_without_reclaim, unified_headroom

GIB = 1 << 30
MIB = 1 << 20
START = 1764547200.0  # 2025-12-01 00:00:00 UTC
CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "alerts" / "corpus"
COLLECTORS = ("meminfo", "vmstat", "pressure", "buddyinfo", "headroom", "processes", "kmsg")


@dataclass
class Node:
    """The state of a node at one second; the scenario changes it, `record()` turns it into series."""

    mem_total: float
    mem_available: float
    free_contiguous: float
    thp_alloc: int = 0
    thp_fallback: int = 0
    psi_some: float = 0.0
    psi_full: float = 0.0
    nv_err: int = 0
    nv_err_last_seen: float | None = None
    nvml: bool = True
    oom_kills: int = 0
    oom_last_seen: float | None = None
    swap_in: int = 0    # pages swapped in since boot (/proc/vmstat pswpin)
    swap_out: int = 0
    processes: int | None = None  # serving processes the daemon's process collector matches (role vllm)
    window: FaultWindow = field(default_factory=lambda: FaultWindow())
    # What each starting engine's hook says its start will still take ({"rank/pid": bytes}), as read last.
    start_remaining: dict[str, float] = field(default_factory=dict)
    # Series of the serving engine (vLLM's /metrics, the hook's call counts), recorded as they are.
    serving: dict[str, float] = field(default_factory=dict)

    def record(self, now: float) -> dict:
        self.window.clock = lambda: now
        outcomes = self.window.add({"thp_fault_alloc": self.thp_alloc, "thp_fault_fallback": self.thp_fallback})
        ratio = outcomes.success_ratio if outcomes else None
        available, contiguous = int(self.mem_available), int(min(self.free_contiguous, self.mem_available))
        values = {
            "memtel_node_mem_total_bytes": self.mem_total,
            "memtel_node_mem_available_bytes": available,
            "memtel_node_mem_free_contiguous_bytes": contiguous,
            "memtel_node_unified_headroom_bytes": unified_headroom(available, contiguous, ratio),
            "memtel_node_unified_headroom_without_reclaim_bytes": headroom_without_reclaim(available, contiguous),
            "memtel_node_vmstat_thp_fault_alloc_total": self.thp_alloc,
            "memtel_node_vmstat_thp_fault_fallback_total": self.thp_fallback,
            "memtel_node_vmstat_pswpin_total": self.swap_in, "memtel_node_vmstat_pswpout_total": self.swap_out,
            "memtel_node_pressure_memory_some_seconds_total": round(self.psi_some, 6),
            "memtel_node_pressure_memory_full_seconds_total": round(self.psi_full, 6),
            "memtel_node_page_size_bytes": 4096,
            "memtel_kernel_nv_err_no_memory_total": self.nv_err,
            "memtel_kernel_oom_kills_total": self.oom_kills,
            "memtel_kernel_kmsg_missed_records_total": 0,
            "memtel_gpu_nvml_available": 1 if self.nvml else 0,
            'memtel_collector_success{collector="nvml"}': 1 if self.nvml else 0,
        }
        if ratio is not None:
            values["memtel_node_huge_page_fault_success_ratio"] = ratio
        if self.nv_err_last_seen is not None:
            values["memtel_kernel_nv_err_no_memory_last_seen_timestamp_seconds"] = self.nv_err_last_seen
        if self.oom_last_seen is not None:
            values["memtel_kernel_oom_kill_last_seen_timestamp_seconds"] = self.oom_last_seen
        if self.processes is not None:
            values['memtel_process_role_processes{role="vllm"}'] = self.processes
        for name in COLLECTORS:
            values[f'memtel_collector_success{{collector="{name}"}}'] = 1
        values.update(self.serving)
        for engine, remaining in sorted(self.start_remaining.items()):
            rank, pid = engine.split("/")
            values[f'memtel_engine_start_remaining_bytes{{pid="{pid}",rank="{rank}"}}'] = int(remaining)
        return {"time": now, "values": values}


Step = Callable[[Node, int, random.Random], None]


def timeline(header: dict, node: Node, seconds: int, step: Step, seed: int) -> Iterator[dict]:
    rng = random.Random(seed)
    yield {"memtel_timeline": header}
    for second in range(seconds):
        step(node, second, rng)
        yield node.record(START + second)


def _huge_faults(node: Node, per_second: int, success: float, rng: random.Random) -> None:
    got = sum(1 for _ in range(per_second) if rng.random() < success)
    node.thp_alloc += got
    node.thp_fallback += per_second - got


# -- failures ------------------------------------------------------------------------------------------------
def collapse() -> Iterator[dict]:
    """29 GiB to 2.5 GiB in 9 s on a 120 GiB node (the reported collapse), 60 s steady before it; the host
    wedges 20 s after the fall began (records stop)."""
    onset = 60

    def step(node: Node, s: int, rng: random.Random) -> None:
        fall = min(max(s - onset, 0) / 9, 1.0)
        node.mem_available = 29 * GIB - (29 - 2.5) * GIB * fall + rng.uniform(-64, 64) * MIB * (fall < 1)
        node.free_contiguous = node.mem_available - 2 * GIB * (1 - fall)
        if s > onset + 9:
            node.nv_err += 3
            node.nv_err_last_seen = START + s
            node.psi_some += 0.6
            node.psi_full += 0.4

    header = {"outcome": "failure", "failure_at": START + onset + 20, "onset_at": START + onset, "node": "spark-a",
              "description": "The reported collapse replayed: headroom 29 GiB to 2.5 GiB in 9 s on a 120 GiB node "
                             "(MemAvailable falls with it), NV_ERR_NO_MEMORY lines after, the host wedges 20 s in.",
              "expect": [{"alert": "MemtelUnifiedHeadroomFalling", "within_s": 5}]}
    return timeline(header, Node(120 * GIB, 29 * GIB, 27 * GIB), onset + 20, step, seed=1)


def slow_leak_to_failure() -> Iterator[dict]:
    """A 24 GiB node whose serving process leaks 8 MiB/s from 14 GiB of headroom until allocations fail."""
    seconds = 14 * GIB // (8 * MIB) + 60

    def step(node: Node, s: int, rng: random.Random) -> None:
        node.mem_available = max(14 * GIB - 8 * MIB * max(s - 60, 0), 256 * MIB) + rng.uniform(-32, 32) * MIB
        node.free_contiguous = node.mem_available * 0.3
        if node.mem_available < 1 * GIB and s % 5 == 0:
            node.nv_err += 1
            node.nv_err_last_seen = START + s

    header = {"outcome": "failure", "failure_at": START + seconds, "onset_at": START + 60, "node": "box-24g",
              "description": "A slow leak, 8 MiB/s for 30 minutes, from 14 GiB of headroom down to the allocation "
                             "that fails.",
              "expect": [{"alert": "MemtelUnifiedHeadroomLow"}]}
    return timeline(header, Node(24 * GIB, 14 * GIB, 4 * GIB), seconds, step, seed=2)


def fragmentation_with_free_memory() -> Iterator[dict]:
    """20 GiB available on a 120 GiB node, almost none of it in 2 MiB blocks, and the huge-page faults of a
    growing server fall back more and more (the compaction livelock of MiaAI DSV4.1 #23, the 0 free large
    blocks of sparkring #173); the driver fails with 8.7 GiB still available."""
    seconds = 900

    def step(node: Node, s: int, rng: random.Random) -> None:
        node.mem_available = 20 * GIB - 11.3 * GIB * s / seconds + rng.uniform(-128, 128) * MIB
        node.free_contiguous = 0.6 * GIB * (1 - s / seconds) + 32 * MIB
        _huge_faults(node, 40, max(0.95 - 1.2 * s / seconds, 0.02), rng)
        node.psi_some += 0.02 + 0.3 * s / seconds
        if s > seconds - 120 and s % 10 == 0:
            node.nv_err += 1
            node.nv_err_last_seen = START + s

    header = {"outcome": "failure", "failure_at": START + seconds, "onset_at": START, "node": "spark-frag",
              "description": "Fragmentation with free memory left: 20 to 8.7 GiB available, under 1 GiB in 2 MiB "
                             "blocks, huge-page faults failing more and more; the driver fails at the end.",
              "expect": [{"alert": "MemtelUnifiedHeadroomLow"}]}
    return timeline(header, Node(120 * GIB, 20 * GIB, 0.6 * GIB), seconds, step, seed=3)


# -- benign --------------------------------------------------------------------------------------------------
def page_cache_churn() -> Iterator[dict]:
    """A healthy 24 GiB node whose page cache fills from files larger than memory and churns for 16 minutes:
    MemAvailable 18-23 GiB, free 2 MiB blocks 0.1-6.7 GiB (what the old headroom read), huge-page faults of
    a madvised process succeed."""

    def step(node: Node, s: int, rng: random.Random) -> None:
        node.mem_available = 20.5 * GIB + 2.2 * GIB * math.sin(s / 37) + rng.uniform(-0.5, 0.5) * GIB
        node.free_contiguous = max(20 * GIB - 0.5 * GIB * s, 0.1 * GIB + 3.2 * GIB * (1 + math.sin(s / 9)))
        _huge_faults(node, rng.randint(0, 6), 0.97, rng)
        node.psi_some += 0.002

    header = {"outcome": "benign", "node": "box-24g",
              "description": "Page cache filled from files larger than memory and churned, 16 minutes, no memory "
                             "pressure (the run of issue 20's first paragraph)."}
    return timeline(header, Node(24 * GIB, 22 * GIB, 20 * GIB), 960, step, seed=4)


def model_weights_in_page_cache() -> Iterator[dict]:
    """A 128 GB node reading 100 GiB of model weights through the page cache at 2 GiB/s, then serving."""

    def step(node: Node, s: int, rng: random.Random) -> None:
        cached = min(2 * GIB * s, 100 * GIB)
        node.mem_available = 118 * GIB - 0.02 * cached + rng.uniform(-0.2, 0.2) * GIB
        node.free_contiguous = max(110 * GIB - cached, 1.5 * GIB)
        _huge_faults(node, rng.randint(0, 4), 0.98, rng)

    header = {"outcome": "benign", "node": "spark-weights",
              "description": "100 GiB of model weights read into the page cache: free 2 MiB blocks fall to 1.5 GiB, "
                             "MemAvailable stays near 116 GiB."}
    return timeline(header, Node(120 * GIB, 118 * GIB, 110 * GIB), 600, step, seed=5)


def large_flat_allocation() -> Iterator[dict]:
    """vLLM starting on a 120 GiB node: weights and KV cache take 60 GiB in 30 s, then it serves flat."""

    def step(node: Node, s: int, rng: random.Random) -> None:
        taken = min(max(s - 60, 0) * 2 * GIB, 60 * GIB)
        node.mem_available = 100 * GIB - taken + rng.uniform(-0.3, 0.3) * GIB
        node.free_contiguous = node.mem_available - 4 * GIB
        _huge_faults(node, 20 if 60 <= s < 90 else 0, 0.99, rng)

    header = {"outcome": "benign", "node": "spark-start",
              "description": "A large allocation that stays flat: 100 GiB to 40 GiB of headroom in 30 s (an engine's "
                             "weights and KV cache), then 10 minutes flat."}
    return timeline(header, Node(120 * GIB, 100 * GIB, 96 * GIB), 720, step, seed=6)


def slow_leak_above_floor() -> Iterator[dict]:
    """A 120 GiB node losing 20 MiB/s for 20 minutes, from 60 GiB to 36.6 GiB, then flat: above every floor."""

    def step(node: Node, s: int, rng: random.Random) -> None:
        node.mem_available = 60 * GIB - 20 * MIB * min(s, 1200) + rng.uniform(-0.2, 0.2) * GIB
        node.free_contiguous = node.mem_available - 8 * GIB

    header = {"outcome": "benign", "node": "spark-leak",
              "description": "A slow leak that stops above the floor: 60 GiB to 36.6 GiB over 20 minutes, then flat."}
    return timeline(header, Node(120 * GIB, 60 * GIB, 52 * GIB), 1500, step, seed=7)


def nv_err_at_rest() -> Iterator[dict]:
    """A healthy node logging NV_ERR_NO_MEMORY lines at rest (55 in two days on one host: vLLM #56824)."""

    def step(node: Node, s: int, rng: random.Random) -> None:
        node.mem_available = 100 * GIB + rng.uniform(-0.3, 0.3) * GIB
        node.free_contiguous = 90 * GIB
        if s in (120, 121, 400, 760, 1100):
            node.nv_err += 2
            node.nv_err_last_seen = START + s

    header = {"outcome": "benign", "node": "spark-rest",
              "description": "NV_ERR_NO_MEMORY lines at rest on a healthy node, 100 GiB of headroom throughout."}
    return timeline(header, Node(120 * GIB, 100 * GIB, 90 * GIB), 1200, step, seed=8)


def no_nvidia_driver() -> Iterator[dict]:
    """A node without an NVIDIA driver: the nvml collector reports NVML unavailable for 20 minutes."""

    def step(node: Node, s: int, rng: random.Random) -> None:
        node.mem_available = 20 * GIB + rng.uniform(-0.5, 0.5) * GIB
        node.free_contiguous = 12 * GIB

    header = {"outcome": "benign", "node": "cpu-box",
              "description": "No NVIDIA driver: NVML cannot load; everything else healthy for 20 minutes."}
    return timeline(header, Node(24 * GIB, 20 * GIB, 12 * GIB, nvml=False), 1200, step, seed=9)


# -- engine starts (issue 29) ----------------------------------------------------------------------------------
SPARK_TOTAL = 120 * GIB
SPARK_BASE = 116 * GIB  # what an idle Spark-sized node has available (the OS and desktop hold the rest)


@dataclass
class EngineStart:
    """One vLLM engine starting on a unified-memory node, by the second: init_device returns at `begin` (its
    budget, `util` of the node, known: the hook says what the start will still take from then on, read every
    `read_every` s as the memtel-hook job scrapes); the weights load at `weights_rate`; a profile run takes
    `profile` over 2 s; the KV cache takes the rest of the budget but the graphs at `kv_rate`; graph capture
    takes `graphs` over `capture_s`; then warm-up returns and the series goes away. Optionally it crashes at
    `crash` (what it held returns to the node within 2 s)."""

    begin: int
    util: float
    weights: float
    pid: int
    weights_rate: float = 2 * GIB
    profile: float = 4 * GIB
    kv_rate: float = 8 * GIB
    graphs: float = 1 * GIB
    capture_s: int = 20
    read_every: int = 5
    crash: int | None = None
    hook: bool = True
    read: float = 0.0

    @property
    def budget(self) -> float:
        return self.util * SPARK_TOTAL

    def phases(self) -> tuple[int, int, int, int]:
        """When the weights are loaded, the profile run is done, the KV cache is allocated, warm-up returns."""
        loaded = self.begin + math.ceil(self.weights / self.weights_rate)
        profiled = loaded + 2
        kv = self.budget - self.weights - self.profile - self.graphs
        allocated = profiled + math.ceil(kv / self.kv_rate)
        return loaded, profiled, allocated, allocated + self.capture_s

    def held(self, s: int) -> float:
        if s < self.begin:
            return 0.0
        loaded, profiled, allocated, _ = self.phases()
        held = min(self.weights, self.weights_rate * (s - self.begin))
        held += self.profile * min(max(s - loaded, 0) / 2, 1)
        held += min(self.budget - self.weights - self.profile - self.graphs, self.kv_rate * max(s - profiled, 0))
        held += self.graphs * min(max(s - allocated, 0) / self.capture_s, 1)
        if self.crash is not None and s >= self.crash:
            held *= max(1 - (s - self.crash + 1) / 2, 0)
        return held

    def step(self, node: Node, s: int) -> None:
        key = f"0/{self.pid}"
        _, _, _, ready = self.phases()
        if not self.hook or not self.begin <= s < ready or (self.crash is not None and s >= self.crash):
            node.start_remaining.pop(key, None)
            return
        if (s - self.begin) % self.read_every == 0:
            self.read = max(self.budget - self.held(s), 0.0)
        node.start_remaining[key] = self.read


def starts(engines: list[EngineStart], base: float = SPARK_BASE) -> Step:
    """A Spark-sized node with `base` available before `engines` start; the headroom is what they leave."""

    def step(node: Node, s: int, rng: random.Random) -> None:
        for engine in engines:
            engine.step(node, s)
        node.mem_available = base - sum(e.held(s) for e in engines) + rng.uniform(-64, 64) * MIB
        node.free_contiguous = node.mem_available - 2 * GIB
        _huge_faults(node, rng.randint(0, 4), 0.98, rng)

    return step


def spark_start(util: float) -> Callable[[], Iterator[dict]]:
    def make() -> Iterator[dict]:
        engine = EngineStart(begin=30, util=util, weights=30 * GIB, pid=4100)
        end = SPARK_BASE - engine.budget
        header = {"outcome": "benign", "node": f"spark-start-{round(util * 100)}",
                  "description": f"vLLM starting on a 120 GiB node at gpu_memory_utilization {util}: 30 GiB of "
                                 f"weights, a profile run, the KV cache in seconds, graph capture; the headroom "
                                 f"settles at {end / GIB:.0f} GiB. The hook announces the start."}
        return timeline(header, Node(SPARK_TOTAL, SPARK_BASE, SPARK_BASE - 2 * GIB), 150, starts([engine]),
                        seed=10 + round(util * 100))
    return make


def restart_loop() -> Iterator[dict]:
    """An engine at 0.85 that crashes a minute after each start and is restarted (systemd's Restart=), 3 times."""
    engines = [EngineStart(begin=20, util=0.85, weights=30 * GIB, pid=4200, crash=150),
               EngineStart(begin=165, util=0.85, weights=30 * GIB, pid=4201, crash=295),
               EngineStart(begin=310, util=0.85, weights=30 * GIB, pid=4202)]
    header = {"outcome": "benign", "node": "spark-restarts",
              "description": "A restart loop: vLLM at gpu_memory_utilization 0.85 starts, crashes 2 minutes later "
                             "(its memory returns), and is restarted, three starts in 7 minutes."}
    return timeline(header, Node(SPARK_TOTAL, SPARK_BASE, SPARK_BASE - 2 * GIB), 420, starts(engines), seed=20)


def two_engines_starting() -> Iterator[dict]:
    """Two engines at 0.4 each started together on one node (two models behind one router)."""
    engines = [EngineStart(begin=30, util=0.4, weights=15 * GIB, pid=4300),
               EngineStart(begin=32, util=0.4, weights=15 * GIB, pid=4301, read_every=5)]
    header = {"outcome": "benign", "node": "spark-two",
              "description": "Two engines at gpu_memory_utilization 0.4 each start together; their KV caches "
                             "overlap; the headroom settles at 20 GiB."}
    return timeline(header, Node(SPARK_TOTAL, SPARK_BASE, SPARK_BASE - 2 * GIB), 150, starts(engines), seed=21)


def start_on_a_low_node() -> Iterator[dict]:
    """A node already low (another engine serves: 34 GiB left) where a small engine at 0.2 starts."""
    engine = EngineStart(begin=30, util=0.2, weights=8 * GIB, pid=4400)
    header = {"outcome": "benign", "node": "spark-low",
              "description": "A second, small engine (gpu_memory_utilization 0.2, 8 GiB of weights) starts on a "
                             "node that has 34 GiB left; the headroom settles at 10 GiB."}
    return timeline(header, Node(SPARK_TOTAL, 34 * GIB, 32 * GIB), 150, starts([engine], base=34 * GIB), seed=22)


def start_asks_too_much() -> Iterator[dict]:
    """An engine at 0.85 started on a node where another engine already holds 56 GiB: its KV cache takes the
    node to nothing (the host wedges)."""
    engine = EngineStart(begin=30, util=0.85, weights=24 * GIB, pid=4500, kv_rate=4 * GIB)
    _, profiled, _, _ = engine.phases()
    base = 60 * GIB
    wedge = profiled + math.ceil((base - engine.weights - engine.profile) / engine.kv_rate) + 2

    def step(node: Node, s: int, rng: random.Random) -> None:
        starts([engine], base=base)(node, s, rng)
        node.mem_available = max(node.mem_available, 256 * MIB)
        node.free_contiguous = max(node.mem_available - 2 * GIB, 64 * MIB)

    header = {"outcome": "failure", "failure_at": START + wedge, "onset_at": START + profiled,
              "node": "spark-too-much",
              "description": "vLLM at gpu_memory_utilization 0.85 (a 102 GiB budget) starts on a node with 60 GiB "
                             "available: its KV cache allocation takes the node to nothing and the host wedges.",
              "expect": [{"alert": "MemtelUnifiedHeadroomFalling", "within_s": 5}]}
    return timeline(header, Node(SPARK_TOTAL, base, base - 2 * GIB), wedge, step, seed=23)


def collapse_during_start() -> Iterator[dict]:
    """The 0.85 start; while its graphs are captured (KV cache allocated, still starting) another process takes
    the reported collapse's share: 14 GiB to 2 GiB at 3 GiB/s; the host wedges 20 s later."""
    engine = EngineStart(begin=30, util=0.85, weights=30 * GIB, pid=4600, capture_s=60)
    _, _, allocated, _ = engine.phases()
    onset = allocated + 10
    started = starts([engine])

    def step(node: Node, s: int, rng: random.Random) -> None:
        started(node, s, rng)
        node.mem_available = max(node.mem_available - 3 * GIB * max(s - onset, 0), 2 * GIB)
        node.free_contiguous = node.mem_available - 1 * GIB

    header = {"outcome": "failure", "failure_at": START + onset + 20, "onset_at": START + onset,
              "node": "spark-collapse-start",
              "description": "A collapse while an engine starts: its KV cache is allocated (14 GiB left, as "
                             "planned) and graphs are being captured when another process takes 12 GiB in 4 s.",
              "expect": [{"alert": "MemtelUnifiedHeadroomFalling", "within_s": 10}]}
    return timeline(header, Node(SPARK_TOTAL, SPARK_BASE, SPARK_BASE - 2 * GIB), onset + 20, step, seed=24)


# -- the serving engine (issue 29) ----------------------------------------------------------------------------
RUNNING, GENERATED, PROMPT = "vllm:num_requests_running", "vllm:generation_tokens_total", "vllm:prompt_tokens_total"
STEPS, CALLS = "vllm:iteration_tokens_total_count", 'memtel_hook_calls_total{rank="0",site="attn"}'


def engine_hang() -> Iterator[dict]:
    """Two requests decoding, then the engine hangs (its API and /health still answer): nothing moves; the
    clients give up 5.5 minutes later."""
    onset = 60

    def step(node: Node, s: int, rng: random.Random) -> None:
        node.mem_available = 60 * GIB + rng.uniform(-0.2, 0.2) * GIB
        node.free_contiguous = 50 * GIB
        moving = s < onset
        serving = node.serving
        serving[RUNNING] = 2
        serving[GENERATED] = serving.get(GENERATED, 0) + 40 * moving
        serving[PROMPT] = serving.get(PROMPT, 0) + 100 * (moving and s % 20 == 0)
        serving[STEPS] = serving.get(STEPS, 0) + 20 * moving
        serving[CALLS] = serving.get(CALLS, 0) + 80 * moving

    header = {"outcome": "failure", "failure_at": START + onset + 330, "onset_at": START + onset, "node": "spark-hang",
              "description": "A hung engine: two requests running, no token, step or hooked call from t=60 s while "
                             "its API still answers; the clients time out 5.5 minutes later.",
              "expect": [{"alert": "MemtelEngineStalled", "within_s": 300}]}
    return timeline(header, Node(SPARK_TOTAL, 60 * GIB, 50 * GIB), onset + 340, step, seed=30)


def slow_long_prefill() -> Iterator[dict]:
    """One 1M-token prompt in prefill for 8 minutes: no token out; vLLM steps once a minute (a chunk against a
    long context) and counts its prompt tokens at the end; the hook's attention calls run all along."""

    def step(node: Node, s: int, rng: random.Random) -> None:
        node.mem_available = 40 * GIB - 2 * MIB * s + rng.uniform(-0.2, 0.2) * GIB
        node.free_contiguous = node.mem_available - 4 * GIB
        serving = node.serving
        serving[RUNNING] = 1
        serving[GENERATED] = 0
        serving[PROMPT] = 0
        serving[STEPS] = s // 60
        serving[CALLS] = serving.get(CALLS, 0) + rng.randint(0, 3)

    header = {"outcome": "benign", "node": "spark-prefill",
              "description": "A slow 1M-token prefill: 8 minutes without a token out or a prompt token counted; an "
                             "engine step a minute and hooked attention calls all along."}
    return timeline(header, Node(SPARK_TOTAL, 40 * GIB, 36 * GIB), 480, step, seed=31)


# -- a real DGX Spark (issue 38): 121.69 GiB of MemTotal, 113 GiB available at rest with a desktop session --
REAL_SPARK_TOTAL = 121.69 * GIB
REAL_SPARK_DESKTOP = 113 * GIB   # at rest with a desktop session (113-117 GiB seen: issue 38)


def serving(util: float, base: float) -> float:
    """What a serving engine at `util` leaves available on a real Spark that had `base` at rest."""
    return base - util * REAL_SPARK_TOTAL


def spark_serving(util: float, base: float) -> Callable[[], Iterator[dict]]:
    """A real Spark serving at `util` for 12 minutes, steady (decode), the page cache churning a little."""
    def make() -> Iterator[dict]:
        left = serving(util, base)

        def step(node: Node, s: int, rng: random.Random) -> None:
            node.mem_available = left + rng.uniform(-256, 256) * MIB
            node.free_contiguous = node.mem_available - 1 * GIB
            _huge_faults(node, rng.randint(0, 2), 0.95, rng)

        header = {"outcome": "benign", "node": "spark-desktop" if base == REAL_SPARK_DESKTOP else "spark-headless",
                  "description": f"A DGX Spark (121.69 GiB) with {base / GIB:.0f} GiB available at rest serving "
                                 f"at gpu_memory_utilization {util}: {left / GIB:.1f} GiB stay available for "
                                 "12 minutes of decode."}
        return timeline(header, Node(REAL_SPARK_TOTAL, left, left - GIB, processes=1), 720, step,
                        seed=60 + round(util * 100))
    return make


@dataclass
class SglangStart(EngineStart):
    """SGLang starting: its static memory (weights and KV pool) is `util` (mem_fraction_static) of what was
    available before its weights loaded (`available`), known from init_torch_distributed (its hook says so)."""

    available: float = REAL_SPARK_DESKTOP

    @property
    def budget(self) -> float:
        return self.util * self.available


def sglang_start() -> Iterator[dict]:
    """SGLang at mem_fraction_static 0.85 starting on the real Spark with its desktop (113 GiB available): 96 GiB
    of weights and KV pool, the headroom settles at 17 GiB, below a quarter of the node."""
    engine = SglangStart(begin=30, util=0.85, weights=30 * GIB, pid=4400)
    header = {"outcome": "benign", "node": "spark-desktop",
              "description": "SGLang at mem_fraction_static 0.85 starting on a Spark with a desktop session; its "
                             "hook announces the start from init_torch_distributed."}
    return timeline(header, Node(REAL_SPARK_TOTAL, REAL_SPARK_DESKTOP, REAL_SPARK_DESKTOP - 2 * GIB), 150,
                    starts([engine], base=REAL_SPARK_DESKTOP), seed=74)


@dataclass
class RealSparkStart(EngineStart):
    """vLLM starting on a real Spark: its budget is `util` of the real MemTotal (121.69 GiB)."""

    @property
    def budget(self) -> float:
        return self.util * REAL_SPARK_TOTAL


def start_cold_page_cache() -> Iterator[dict]:
    """vLLM at 0.9 on a real headless Spark (117 GiB available at rest, 8 GiB of it page cache) with a cold page
    cache: the weights are read from disk through the page cache as they load, so the 30 GiB of weights take
    60 GiB of free 2 MiB blocks (their copy and the cached file) and the KV cache runs out of free blocks and
    comes out of the page cache, whose huge-page faults succeed 88 % of the time (issue 38). 7.5 GiB stay
    available, 6.6 GiB of headroom."""
    base, cache, floor = 117 * GIB, 8 * GIB, 512 * MIB
    engine = RealSparkStart(begin=30, util=0.9, weights=30 * GIB, pid=4700)

    def step(node: Node, s: int, rng: random.Random) -> None:
        engine.step(node, s)
        held = engine.held(s)
        cached = cache + min(engine.weights_rate * max(s - engine.begin, 0), engine.weights)
        node.mem_available = base - held + rng.uniform(-64, 64) * MIB
        node.free_contiguous = max(base - cached - held, floor)
        _huge_faults(node, rng.randint(20, 60), 0.88, rng)

    header = {"outcome": "benign", "node": "spark-headless",
              "description": "vLLM at gpu_memory_utilization 0.9 starting on a DGX Spark (121.69 GiB, 117 GiB "
                             "available) with a cold page cache: the weights fill the page cache as they load, "
                             "the KV cache comes out of it at a huge-page success ratio of 0.88; 7.5 GiB stay "
                             "available. The hook announces the start."}
    return timeline(header, Node(REAL_SPARK_TOTAL, base, base - cache), 150, step, seed=75)


def engine_dies_after_nv_err() -> Iterator[dict]:
    """A real Spark with its desktop serving at 0.85; a long prefill's allocator segments take the last
    9.6 GiB at 0.4 GiB/s; the driver logs NV_ERR_NO_MEMORY at t=140 and the engine exits at t=146 (its memory
    returns). The failure is the death: it must page, within a second of the daemon seeing it."""
    left = serving(0.85, REAL_SPARK_DESKTOP)

    def step(node: Node, s: int, rng: random.Random) -> None:
        taken = min(max(s - 120, 0) * 0.4 * GIB, left - 0.3 * GIB)
        node.mem_available = left - taken + rng.uniform(-64, 64) * MIB
        if s >= 146:
            node.processes = 0
            node.mem_available = left + 0.85 * REAL_SPARK_TOTAL * min((s - 145) / 2, 1)
        node.free_contiguous = node.mem_available - GIB
        if s in (140, 141, 143):
            node.nv_err += 1
            node.nv_err_last_seen = START + s
        _huge_faults(node, rng.randint(0, 2), 0.95, rng)

    header = {"outcome": "failure", "failure_at": START + 146, "onset_at": START + 146, "node": "spark-desktop",
              "description": "vLLM at 0.85 on a Spark with a desktop session: NV_ERR_NO_MEMORY, then the engine "
                             "exits. The mission's case: it must page within a second of the process going.",
              "expect": [{"alert": "MemtelEngineDiedOfMemory", "within_s": 1, "severity": "critical"}]}
    return timeline(header, Node(REAL_SPARK_TOTAL, left, left - GIB, processes=1), 200, step, seed=71)


def swap_thrash_to_oom_kill() -> Iterator[dict]:
    """A 24 GiB node with swap: a second job grows past memory and the node thrashes (30-60 MiB/s in and out
    of swap, PSI full 40 %) for 4 minutes from t=300; the OOM killer ends the serving engine at t=540."""
    def step(node: Node, s: int, rng: random.Random) -> None:
        thrashing = 300 <= s < 540
        node.mem_available = (1.2 if thrashing else 6.0) * GIB + rng.uniform(-64, 64) * MIB
        if s >= 540:
            node.mem_available = 14 * GIB
        node.free_contiguous = node.mem_available * 0.5
        if thrashing:
            node.swap_in += rng.randint(30, 60) * 256   # pages of 4 KiB: 30-60 MiB/s
            node.swap_out += rng.randint(30, 60) * 256
            node.psi_some += rng.uniform(0.6, 0.8)
            node.psi_full += rng.uniform(0.3, 0.5)
        if s == 540:
            node.oom_kills += 1
            node.oom_last_seen = START + s
            node.processes = 0
        _huge_faults(node, rng.randint(0, 2), 0.9, rng)

    header = {"outcome": "failure", "failure_at": START + 540, "onset_at": START + 300, "node": "box-24g-swap",
              "description": "Swap thrash for 4 minutes, then the OOM killer ends the serving engine.",
              "expect": [{"alert": "MemtelSwapThrash", "within_s": 180, "severity": "critical"},
                         {"alert": "MemtelEngineDiedOfMemory", "within_s": 241, "severity": "critical"}]}
    return timeline(header, Node(24 * GIB, 6 * GIB, 3 * GIB, processes=1), 600, step, seed=72)


def start_with_an_nv_err_line() -> Iterator[dict]:
    """A real Spark with its desktop: vLLM starts at 0.70 (the process appears at t=20) and the driver logs one
    NV_ERR_NO_MEMORY line while the KV cache is allocated, as normal starts do; then it serves."""
    engine = EngineStart(begin=30, util=0.70, weights=30 * GIB, pid=4300)
    inner = starts([engine], base=REAL_SPARK_DESKTOP)

    def step(node: Node, s: int, rng: random.Random) -> None:
        inner(node, s, rng)
        node.processes = 1 if s >= 20 else 0
        if s == 55:
            node.nv_err += 1
            node.nv_err_last_seen = START + s

    header = {"outcome": "benign", "node": "spark-desktop",
              "description": "vLLM at 0.70 starting on a Spark with a desktop session; one NV_ERR_NO_MEMORY line "
                             "during the start, which succeeds."}
    return timeline(header, Node(REAL_SPARK_TOTAL, REAL_SPARK_DESKTOP, REAL_SPARK_DESKTOP - 2 * GIB, processes=0),
                    240, step, seed=73)


TIMELINES: dict[str, Callable[[], Iterator[dict]]] = {
    "collapse-29-to-2.5-gib-in-9s": collapse,
    "slow-leak-to-failure": slow_leak_to_failure,
    "fragmentation-with-free-memory": fragmentation_with_free_memory,
    "page-cache-churn": page_cache_churn,
    "model-weights-in-page-cache": model_weights_in_page_cache,
    "large-flat-allocation": large_flat_allocation,
    "slow-leak-above-floor": slow_leak_above_floor,
    "nv-err-at-rest": nv_err_at_rest,
    "no-nvidia-driver": no_nvidia_driver,
    "spark-start-0.70": spark_start(0.70),
    "spark-start-0.85": spark_start(0.85),
    "spark-start-0.90": spark_start(0.90),
    "spark-restart-loop": restart_loop,
    "two-engines-starting-together": two_engines_starting,
    "start-on-a-low-node": start_on_a_low_node,
    "start-asks-more-than-the-node-has": start_asks_too_much,
    "collapse-during-an-engine-start": collapse_during_start,
    "engine-hang": engine_hang,
    "slow-1m-token-prefill": slow_long_prefill,
    "spark-desktop-serving-0.85": spark_serving(0.85, REAL_SPARK_DESKTOP),
    "spark-headless-serving-0.90": spark_serving(0.90, 117 * GIB),
    "engine-dies-after-nv-err": engine_dies_after_nv_err,
    "swap-thrash-to-oom-kill": swap_thrash_to_oom_kill,
    "spark-desktop-start-with-an-nv-err-line": start_with_an_nv_err_line,
    "sglang-start-0.85-spark-desktop": sglang_start,
    "spark-headless-start-0.90-cold-page-cache": start_cold_page_cache,
}


def render(name: str) -> bytes:
    """The timeline gzip-compressed with a fixed mtime, so the same code writes the same bytes."""
    text = "".join(json.dumps(line, sort_keys=True) + "\n" for line in TIMELINES[name]())
    return gzip.compress(text.encode(), mtime=0)


def main() -> None:
    parser = argparse.ArgumentParser(description="write the synthetic alert corpus")
    parser.add_argument("--out", type=Path, default=CORPUS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in TIMELINES:
        (args.out / f"{name}.jsonl.gz").write_bytes(render(name))


if __name__ == "__main__":
    main()
