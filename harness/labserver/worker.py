"""One rank of the lab server: a worker process that runs the indexer's logits launches of a prefill.

Each rank plans every chunk step with the indexer planner (stock or fixed width) and, for every layer,
makes the step's logits launches through `harness.indexer.launch:indexer_logits_launch`, the hook target
of the `lab-indexer` preset, so memtel's hook records the allocator and the host after every launch,
exactly as it does on a vLLM worker. Like vLLM's DeepSeek V3.2 indexer (whose query projection is a
ReplicatedLinear), every tensor-parallel rank computes the whole logits buffer, so every rank shows
the same allocation pattern.

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

import ctypes
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("memtel.lab.worker")

HOOK_PRESET = "lab-indexer"


@dataclass(frozen=True)
class RankConfig:
    rank: int
    world_size: int
    arm: str
    allocator: str
    layers: int
    chunk: int
    max_model_len: int
    compress_ratio: int
    budget_bytes: int
    scale: float
    time_scale: float
    alloc_conf: str
    unified_memory: bool
    memtel_port: int | None
    memtel_log_dir: str | None
    hook: bool
    memtel_addr: str = "127.0.0.1"


def _die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when its parent dies (Linux), so no rank outlives its server."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _set_hook_environment(config: RankConfig) -> None:
    # The hook resolves the rank and its exporter port (MEMTEL_PORT + local rank) from these.
    os.environ["RANK"] = str(config.rank)
    os.environ["LOCAL_RANK"] = str(config.rank)
    os.environ["WORLD_SIZE"] = str(config.world_size)
    if config.memtel_port is not None:
        os.environ["MEMTEL_PORT"] = str(config.memtel_port)
    if config.memtel_log_dir:
        os.makedirs(config.memtel_log_dir, exist_ok=True)
        os.environ["MEMTEL_LOG_DIR"] = config.memtel_log_dir


class SimBackend:
    """The caching-allocator simulator, optionally backed by host pages (unified-memory emulation)."""

    name = "sim"

    def __init__(self, config: RankConfig) -> None:
        from harness.allocsim import CachingAllocatorSim

        self.backing = None
        hooks: dict[str, Any] = {}
        if config.unified_memory:
            from harness.labserver.unified_memory import HostBacking

            self.backing = HostBacking()
            hooks = {"on_segment_map": self.backing.map, "on_segment_unmap": self.backing.unmap}
        self.allocator = CachingAllocatorSim(config.alloc_conf, **hooks)
        self.target = self.allocator  # what indexer_logits_launch allocates on

    def stats(self) -> dict:
        return self.allocator.stats()

    def describe(self) -> dict:
        return {"allocator": "sim", "unified_memory": self.backing is not None}

    def host_backed_bytes(self) -> int | None:
        return None if self.backing is None else self.backing.mapped_bytes

    def finish(self) -> None:
        """End of a prefill: nothing is in flight on a simulator."""

    def close(self) -> None:
        if self.backing is not None:
            self.backing.release_all()


class CudaBackend:
    """Real CUDA allocations through PyTorch's caching allocator on this rank's GPU."""

    name = "cuda"

    def __init__(self, config: RankConfig) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("--allocator cuda needs a CUDA GPU and a CUDA build of torch; use --allocator sim")
        self.torch = torch
        self.device = torch.device("cuda", config.rank % torch.cuda.device_count())
        torch.cuda.set_device(self.device)
        torch.cuda.init()
        self.target = self.device

    def stats(self) -> dict:
        stats = self.torch.cuda.memory_stats(self.device)
        return {"reserved_bytes": stats.get("reserved_bytes.all.current", 0),
                "allocated_bytes": stats.get("allocated_bytes.all.current", 0),
                "num_device_alloc": stats.get("num_device_alloc", 0),
                "num_device_free": stats.get("num_device_free", 0),
                "num_alloc_retries": stats.get("num_alloc_retries", 0),
                "num_ooms": stats.get("num_ooms", 0)}

    def describe(self) -> dict:
        properties = self.torch.cuda.get_device_properties(self.device)
        # An integrated GPU (Jetson, GB10-class) takes its memory from the host: MemAvailable moves.
        return {"allocator": "cuda", "device": str(self.device), "device_name": properties.name,
                "integrated": bool(getattr(properties, "is_integrated", False))}

    def host_backed_bytes(self) -> None:
        return None

    def finish(self) -> None:
        """End of a prefill: wait for the GPU, so the time to first token is the GPU's."""
        self.torch.cuda.synchronize(self.device)

    def close(self) -> None:
        pass


class Rank:
    def __init__(self, config: RankConfig) -> None:
        from harness.indexer.planner import PlannerConfig
        from harness.labserver.cost_model import CostModel

        self.config = config
        self.backend = SimBackend(config) if config.allocator == "sim" else CudaBackend(config)
        self.planner = PlannerConfig(mode=config.arm, chunk=config.chunk, compress_ratio=config.compress_ratio,
                                     max_model_len=config.max_model_len, max_logits_bytes=config.budget_bytes)
        self.cost = CostModel(time_scale=config.time_scale)
        self.hook_handle = None
        self.requests = 0
        self.launches = 0

    def install_hook(self) -> None:
        if not self.config.hook:
            return
        import telemetry
        from harness.indexer import launch as indexer
        from telemetry.hook import set_allocator_source

        if self.config.allocator == "sim":
            set_allocator_source(self.backend.stats)
        self.hook_handle = telemetry.install([HOOK_PRESET], port=self.config.memtel_port,
                                             log_dir=self.config.memtel_log_dir, addr=self.config.memtel_addr)
        # The hook starts its exporter at a process's first hooked call; one empty launch (0 rows,
        # nothing allocated) brings it up now, so a scrape before the first request finds this rank.
        indexer.indexer_logits_launch(self.backend.target, 0, 0, 0)

    def scaled_rows(self, rows: int) -> int:
        from harness.indexer.launch import scaled_rows

        return scaled_rows(rows, self.config.scale)

    def prefill(self, start_token: int, tokens: int) -> dict:
        from harness.indexer import launch as indexer
        from harness.indexer.planner import plan_prefill

        before = self.backend.stats()
        started = time.perf_counter()
        charged = 0.0
        launches = 0
        steps = plan_prefill(tokens, self.planner, start_token=start_token)
        growth_steps = []
        target = self.backend.target
        # As `memtel replay` does by default (and a pipeline does): a launch's logits stay alive until
        # the next launch has allocated, across layers and chunk steps; the last is freed at the end.
        previous = None
        for step, step_launches in steps:
            reserved_before = self.backend.stats()["reserved_bytes"]
            for _layer in range(self.config.layers):
                for launch in step_launches:
                    logits = indexer.indexer_logits_launch(target, self.scaled_rows(launch.rows), launch.width,
                                                           launch.kv_len)
                    if previous is not None:
                        indexer.release_logits(target, previous)
                    previous = logits
                    launches += 1
                logits = None
            if self.config.allocator == "sim":
                elements = sum(launch.rows * launch.kv_len for launch in step_launches)
                charged += self.cost.prefill_step_s(step.rows, elements, len(step_launches), self.config.layers)
                delay = started + charged - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            growth = self.backend.stats()["reserved_bytes"] - reserved_before
            if growth:
                growth_steps.append([step.index, step.tokens_so_far, growth])
        if previous is not None:
            indexer.release_logits(target, previous)
            previous = None
        self.backend.finish()
        after = self.backend.stats()
        self.requests += 1
        self.launches += launches
        return {
            "rank": self.config.rank, "pid": os.getpid(), "launches": launches, "chunk_steps": len(steps),
            "seconds": time.perf_counter() - started, "modeled_s": charged if self.config.allocator == "sim" else None,
            "reserved_before": before["reserved_bytes"], "reserved_after": after["reserved_bytes"],
            "device_alloc_before": before["num_device_alloc"], "device_alloc_after": after["num_device_alloc"],
            "growth_steps": growth_steps, "host_backed_bytes": self.backend.host_backed_bytes(),
        }

    def snapshot(self) -> dict:
        return {"rank": self.config.rank, "pid": os.getpid(), "requests": self.requests, "launches": self.launches,
                "allocator": self.backend.stats(), "host_backed_bytes": self.backend.host_backed_bytes(),
                **self.backend.describe()}


def _watch_parent(parent_pid: int) -> None:
    # PR_SET_PDEATHSIG is the first line of defence; this catches a re-parented rank on other kernels.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


def rank_main(config: RankConfig, conn: Any) -> None:
    """Entry point of a rank process: set up, report ready, then serve jobs until told to stop."""
    _die_with_parent()
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="memtel-lab-parent").start()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{config.rank} %(name)s: %(message)s",
                        stream=sys.stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the server, which stops the ranks
    rank = None
    try:
        _set_hook_environment(config)
        rank = Rank(config)
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
                elif kind == "stats":
                    conn.send(("ok", rank.snapshot()))
                else:
                    conn.send(("error", f"unknown job {kind!r}"))
            except Exception as exc:
                log.exception("rank %d: %s failed", config.rank, kind)
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        if rank.hook_handle is not None:
            try:
                rank.hook_handle.uninstall()
            except Exception:
                pass
        rank.backend.close()
