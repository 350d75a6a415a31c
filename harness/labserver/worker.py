"""One rank of the lab server: a worker process that runs the indexer's logits launches of a prefill.

Each rank runs every prefill through the one launch loop (`telemetry.model.indexer.prefill.run_prefill`, the
same as `memtel replay`) on its backend, so every launch goes through
`telemetry.model.indexer.launch:indexer_logits_launch`, the hook target of the `lab-indexer` preset, and
memtel's hook records the allocator and the host after every launch, exactly as it does on a vLLM
worker. Like vLLM's DeepSeek V3.2 indexer (whose query projection is a ReplicatedLinear), every
tensor-parallel rank computes the whole logits buffer, so every rank shows the same allocation pattern.

Allocators:
- `sim`: the caching-allocator simulator; with `unified_memory`, each segment it maps is backed by
  real host pages, so the host's MemAvailable falls as on a unified-memory machine. Time is the cost
  model's, slept as the work goes.
- `cuda`: real CUDA allocations on GPU `rank % device_count`, the computed part of each launch
  written, real time.

`scale` multiplies the rows of every launch (so its bytes); widths, token counts, chunk steps and
the number of launches stay those of the full-size workload.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from harness.labserver.cost_model import CostModel
from harness.labserver.node_memory import LabOutOfMemoryError, NodeLimitedBackend, NodeMemory
from harness.processes import die_with_parent
from telemetry import hook_env
from telemetry.model.indexer.backends import CudaBackend, LaunchBackend, SimBackend
from telemetry.model.indexer.planner import ChunkStep, Launch, Mode
from telemetry.model.indexer.prefill import LaunchPattern, PrefillObserver, run_prefill
from telemetry.model.indexer.shape import IndexerShape

log = logging.getLogger("memtel.lab.worker")

HOOK_PRESET = "lab-indexer"


@dataclass(frozen=True)
class RankConfig:
    rank: int
    world_size: int
    mode: Mode
    allocator: str
    shape: IndexerShape
    scale: float
    time_scale: float
    alloc_conf: str
    unified_memory: bool
    memtel_port: int | None
    memtel_log_dir: str | None
    hook: bool
    memtel_addr: str = "127.0.0.1"
    capacity_bytes: int | None = None  # sim: the node's emulated unified memory, shared by the ranks (node_memory.py)


@dataclass(frozen=True)
class RankPrefill:
    """What one rank did for one request."""

    rank: int
    pid: int
    launches: int
    chunk_steps: int
    seconds: float
    modeled_s: float | None  # the cost model's time (sim), None on CUDA
    reserved_before_bytes: int
    reserved_after_bytes: int
    num_device_alloc_before: int
    num_device_alloc_after: int
    growth_steps: list[tuple[int, int, int]]  # (chunk step, tokens so far, reserved growth bytes)
    host_backed_bytes: int | None


def _set_hook_environment(config: RankConfig) -> None:
    # The hook resolves the rank and its exporter port (MEMTEL_PORT + local rank) from these.
    os.environ["RANK"] = str(config.rank)
    os.environ["LOCAL_RANK"] = str(config.rank)
    os.environ["WORLD_SIZE"] = str(config.world_size)
    os.environ["LOCAL_WORLD_SIZE"] = str(config.world_size)   # every rank on this one node shares its memory
    if config.memtel_port is not None:
        os.environ[hook_env.PORT] = str(config.memtel_port)
    if config.memtel_log_dir:
        os.makedirs(config.memtel_log_dir, exist_ok=True)
        os.environ[hook_env.LOG_DIR] = config.memtel_log_dir


def make_backend(config: RankConfig, node: NodeMemory | None = None) -> tuple[LaunchBackend, Any]:
    """This rank's backend, and its host backing (the unified-memory emulation) or None; with `node` (sim), its
    launches fit in the node's emulated memory."""
    if config.allocator == "cuda":
        import torch

        device_count = torch.cuda.device_count() if torch.cuda.is_available() else 1
        return CudaBackend(config.rank % max(device_count, 1)), None
    backing = None
    if config.unified_memory:
        from harness.labserver.unified_memory import HostBacking

        backing = HostBacking()
        sim = SimBackend(config.alloc_conf, on_segment_map=backing.map, on_segment_unmap=backing.unmap)
    else:
        sim = SimBackend(config.alloc_conf)
    if node is not None:
        return cast(LaunchBackend, NodeLimitedBackend(sim, node, config.rank)), backing
    return sim, backing


@dataclass
class _StepClock(PrefillObserver):
    """Per chunk step: the cost model's time slept (sim) and the reserved growth."""

    backend: LaunchBackend
    shape: IndexerShape
    cost: CostModel | None  # None: real time (CUDA)
    started: float = field(default_factory=time.perf_counter)
    charged: float = 0.0
    reserved_before: int = 0
    growth_steps: list[tuple[int, int, int]] = field(default_factory=list)

    def step_started(self, step: ChunkStep, launches: list[Launch]) -> None:
        self.reserved_before = self.backend.counters().reserved_bytes

    def step_ended(self, step: ChunkStep, launches: list[Launch]) -> None:
        if self.cost is not None:
            elements = sum(launch.computed_elements for launch in launches)
            self.charged += self.cost.prefill_step_s(step.rows, elements, len(launches), self.shape.layers)
            delay = self.started + self.charged - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        growth = self.backend.counters().reserved_bytes - self.reserved_before
        if growth:
            self.growth_steps.append((step.index, step.tokens_so_far, growth))


class Rank:
    def __init__(self, config: RankConfig, node: NodeMemory | None = None) -> None:
        self.config = config
        self.node = node
        self.backend, self.backing = make_backend(config, node)
        self.pattern = LaunchPattern(row_scale=config.scale)
        self.cost = CostModel(time_scale=config.time_scale)
        self.hook_handle: Any = None
        self.requests = 0
        self.launches = 0

    def install_hook(self) -> None:
        if not self.config.hook:
            return
        import telemetry
        from telemetry.fit_budget import node_headroom, set_forecast_budget
        from telemetry.hook import set_allocator_source
        from telemetry.hook.config import forecast_options
        from telemetry.hook.forecast import set_forecast_workload

        sim = self.config.allocator == "sim"
        if sim:
            set_allocator_source(self.backend.counters, snapshot=cast(SimBackend, self.backend).snapshot)
        # The live forecast (MEMTEL_FORECAST_TOKENS ...) simulates this rank's own workload: its shape, mode and
        # row scale, and on sim its allocator settings (on cuda, torch's: the environment's).
        forecast = forecast_options(os.environ)
        if forecast:
            set_forecast_workload(self.config.shape, mode=self.config.mode, pattern=self.pattern,
                                  alloc_conf=self.config.alloc_conf if sim else None)
            # The fit budget: the emulated node's free memory (no other tenant: no reserve unless
            # MEMTEL_GUARD_RESERVE_MB says), else, with host-backed segments, the host's own headroom.
            if self.node is not None:
                set_forecast_budget(self.node.free_bytes, reserve_mib=0)
            elif sim and self.backing is not None:
                set_forecast_budget(node_headroom)
        self.hook_handle = telemetry.install([HOOK_PRESET], port=self.config.memtel_port,
                                             log_dir=self.config.memtel_log_dir, addr=self.config.memtel_addr,
                                             **forecast)
        # The hook starts its exporter at a process's first hooked call; one empty launch (0 rows,
        # nothing allocated) brings it up now, so a scrape before the first request finds this rank.
        self.backend.release(self.backend.launch(0, 0, 0))

    def host_backed_bytes(self) -> int | None:
        return None if self.backing is None else self.backing.mapped_bytes

    def prefill(self, start_token: int, tokens: int) -> RankPrefill:
        before = self.backend.counters()
        clock = _StepClock(self.backend, self.config.shape, self.cost if self.config.allocator == "sim" else None)
        done = run_prefill(self.backend, self.config.shape, self.config.mode, tokens, start_token=start_token,
                           pattern=self.pattern, observer=clock)
        self.backend.finish()
        after = self.backend.counters()
        self.requests += 1
        self.launches += done.launches
        return RankPrefill(
            rank=self.config.rank, pid=os.getpid(), launches=done.launches, chunk_steps=done.chunk_steps,
            seconds=time.perf_counter() - clock.started,
            modeled_s=clock.charged if clock.cost is not None else None,
            reserved_before_bytes=before.reserved_bytes, reserved_after_bytes=after.reserved_bytes,
            num_device_alloc_before=before.num_device_alloc, num_device_alloc_after=after.num_device_alloc,
            growth_steps=clock.growth_steps, host_backed_bytes=self.host_backed_bytes())

    def snapshot(self) -> dict[str, Any]:
        return {"rank": self.config.rank, "pid": os.getpid(), "requests": self.requests, "launches": self.launches,
                "counters": self.backend.counters().as_dict(), "host_backed_bytes": self.host_backed_bytes(),
                "unified_memory": self.backing is not None, **self.backend.describe()}

    def close(self) -> None:
        self.backend.close()
        if self.backing is not None:
            self.backing.release_all()


def _watch_parent(parent_pid: int) -> None:
    # PR_SET_PDEATHSIG is the first line of defence; this catches a re-parented rank on other kernels.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


def rank_main(config: RankConfig, conn: Any, node: NodeMemory | None = None) -> None:
    """Entry point of a rank process: set up, report ready, then serve prefills until told to stop."""
    die_with_parent()
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="memtel-lab-parent").start()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{config.rank} %(name)s: %(message)s",
                        stream=sys.stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the server, which stops the ranks
    try:
        _set_hook_environment(config)
        rank = Rank(config, node)
        rank.install_hook()
        conn.send(("ok", {**rank.snapshot(), "config": asdict(config)}))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    try:
        while True:
            try:
                kind, job = conn.recv()
            except (EOFError, OSError):
                break  # the server is gone
            if kind == "stop":
                break
            try:
                if kind == "prefill":
                    conn.send(("ok", rank.prefill(job["start_token"], job["tokens"])))
                else:
                    conn.send(("error", f"unknown job {kind!r}"))
            except LabOutOfMemoryError as exc:
                log.error("rank %d: prefill of %d tokens failed: %s", config.rank, job.get("tokens", 0), exc)
                conn.send(("out_of_memory", str(exc)))
            except Exception as exc:
                log.exception("rank %d: %s failed", config.rank, kind)
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        if rank.hook_handle is not None:
            try:
                rank.hook_handle.uninstall()
            except Exception:
                pass
        rank.close()
