"""The lab engine: the scheduler side of the lab server, driving one worker process per rank.

Like vLLM's engine core with tensor parallelism, every prefill goes to all ranks at once and is done
when the slowest rank is done. The prefix cache lives here, as vLLM's does in its scheduler: a
prompt's cached full blocks are not sent to the ranks again, so only the new tokens are prefilled
(with the kv length of the whole prompt so far, as a real chunked prefill after a cache hit has).

Workers are `multiprocessing` spawn processes (no fork: CUDA and threads do not survive a fork).
Each is told to die with this process (PR_SET_PDEATHSIG) and also exits when its pipe closes.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from harness.labserver.cost_model import CostModel
from harness.labserver.node_memory import NodeMemory
from harness.labserver.prefix_cache import DEFAULT_BLOCK_SIZE, PrefixCache
from harness.labserver.tenant import Tenant, TenantPlan
from harness.labserver.worker import RankConfig, RankPrefill, rank_main
from telemetry.errors import ConfigError, RunError
from telemetry.model.indexer.backends import ALLOCATORS
from telemetry.model.indexer.planner import MODES, Mode
from telemetry.model.indexer.shape import REFERENCE_SHAPE, IndexerShape

log = logging.getLogger("memtel.lab.engine")


class EngineError(RunError):
    """A rank failed, died or did not answer."""


class EngineOutOfMemoryError(EngineError):
    """A rank ran out of the node's memory during a prefill: the engine is dead, as vLLM's engine core is then."""


# The simulator's defaults for `memtel lab serve` and `memtel demo` (cuda runs at scale 1).
DEFAULT_SIM_SCALE = 0.25  # keeps the demo's host-backed memory near 2.5 GiB on a 24 GiB box
DEFAULT_SIM_TIME_SCALE = 0.05


@dataclass(frozen=True)
class LabConfig:
    """Everything that shapes the lab server's work; defaults are the user's A/B profile."""

    mode: Mode = "stock"
    ranks: int = 2
    allocator: str = "sim"
    shape: IndexerShape = REFERENCE_SHAPE
    scale: float = 1.0  # multiplies the rows (so the bytes) of every logits launch
    time_scale: float = 1.0  # multiplies the simulator's modeled time
    alloc_conf: str = ""  # PYTORCH_CUDA_ALLOC_CONF for the simulator (cuda: the environment's)
    unified_memory: bool = True  # sim: back segments with host pages
    block_size: int = DEFAULT_BLOCK_SIZE
    prefix_cache_tokens: int = 1_048_576
    memtel_port: int | None = None  # hook exporter base port (MEMTEL_PORT); None: no exporter
    memtel_log_dir: str | None = None  # hook JSONL logs (MEMTEL_LOG_DIR)
    memtel_addr: str = "127.0.0.1"  # where the hook exporters listen (the server's --host)
    hook: bool = True
    startup_timeout_s: float = 120.0
    capacity_bytes: int | None = None  # sim: the node's emulated unified memory for all ranks (None: unlimited)
    tenant: TenantPlan | None = None  # another process that takes some of that memory for a while (tenant.py)

    def __post_init__(self) -> None:
        problems = []
        if self.mode not in MODES:
            problems.append(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.allocator not in ALLOCATORS:
            problems.append(f"allocator must be one of {', '.join(ALLOCATORS)}, got {self.allocator!r}")
        for name in ("ranks", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if not (0 < self.scale <= 1):
            problems.append(f"scale must be in (0, 1], got {self.scale!r}")
        if not (self.time_scale >= 0):
            problems.append(f"time_scale must be >= 0, got {self.time_scale!r}")
        if self.capacity_bytes is not None and (self.allocator != "sim" or self.capacity_bytes < 1):
            problems.append(f"capacity_bytes needs the sim allocator and a positive size, got {self.capacity_bytes!r} "
                            f"with {self.allocator}")
        if self.tenant is not None and (self.capacity_bytes is None or self.tenant.nbytes > self.capacity_bytes):
            problems.append(f"a tenant takes part of the node's emulated memory: it needs capacity_bytes of at least "
                            f"its {self.tenant.nbytes!r}, got {self.capacity_bytes!r}")
        if self.prefix_cache_tokens < 0:
            problems.append(f"prefix_cache_tokens must be >= 0, got {self.prefix_cache_tokens!r}")
        if problems:
            raise ConfigError("; ".join(problems))

    def rank_config(self, rank: int) -> RankConfig:
        return RankConfig(
            rank=rank, world_size=self.ranks, mode=self.mode, allocator=self.allocator, shape=self.shape,
            scale=self.scale, time_scale=self.time_scale, alloc_conf=self.alloc_conf,
            unified_memory=self.unified_memory, memtel_port=self.memtel_port, memtel_log_dir=self.memtel_log_dir,
            hook=self.hook, memtel_addr=self.memtel_addr, capacity_bytes=self.capacity_bytes,
        )


@dataclass
class PrefillOutcome:
    prompt_tokens: int
    cached_tokens: int
    seconds: float
    ranks: list[RankPrefill] = field(default_factory=list)

    @property
    def launches(self) -> int:
        return sum(r.launches for r in self.ranks)


class _Rank:
    def __init__(self, rank: int, process: Any, conn: Any) -> None:
        self.rank = rank
        self.process = process
        self.conn = conn
        self.info: dict = {}


class LabEngine:
    def __init__(self, config: LabConfig) -> None:
        self.config = config
        self.prefix_cache = PrefixCache(config.prefix_cache_tokens // config.block_size, config.block_size)
        self._ranks: list[_Rank] = []
        self._problem: str | None = "not started"
        self._lock = threading.Lock()
        self.cost = CostModel(time_scale=config.time_scale)
        self.node: NodeMemory | None = None   # the emulated unified memory (--capacity-gb)
        self.tenant: Tenant | None = None   # another process on that node (--tenant, POST /lab/tenant)

    # --- lifecycle ---

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")
        if self.config.capacity_bytes is not None:
            self.node = NodeMemory(self.config.capacity_bytes, self.config.ranks, context)
        try:
            for index in range(self.config.ranks):
                parent, child = context.Pipe()
                process = context.Process(target=rank_main, args=(self.config.rank_config(index), child, self.node),
                                          name=f"memtel-lab-rank{index}", daemon=True)
                process.start()
                child.close()
                self._ranks.append(_Rank(index, process, parent))
            deadline = time.monotonic() + self.config.startup_timeout_s
            for rank in self._ranks:
                rank.info = self._receive(rank, deadline, "start")
        except BaseException:
            self.stop()
            raise
        self._problem = None
        if self.node is not None:
            self.tenant = Tenant(self.node)
            if self.config.tenant is not None:
                self.tenant.schedule(self.config.tenant)
        log.info("lab engine up: %s", ", ".join(
            f"rank {r.rank} pid {r.info.get('pid')} ({r.info.get('allocator')}"
            f"{' ' + r.info['device_name'] if r.info.get('device_name') else ''})" for r in self._ranks))

    def stop(self, grace_s: float = 5.0) -> None:
        self._problem = self._problem or "stopped"
        if self.tenant is not None:
            self.tenant.stop()
        for rank in self._ranks:
            try:
                rank.conn.send(("stop", {}))
            except (OSError, EOFError, BrokenPipeError):
                pass
        deadline = time.monotonic() + grace_s
        for rank in self._ranks:
            rank.process.join(max(0.0, deadline - time.monotonic()))
            if rank.process.is_alive():
                rank.process.terminate()
                rank.process.join(2.0)
            if rank.process.is_alive():
                rank.process.kill()
                rank.process.join(2.0)
            rank.conn.close()
        self._ranks = []

    def healthy(self) -> bool:
        if self._problem is None:
            for rank in self._ranks:
                if not rank.process.is_alive():
                    self._problem = f"rank {rank.rank} (pid {rank.process.pid}) exited with {rank.process.exitcode}"
        return self._problem is None

    def problem(self) -> str:
        return self._problem or ""

    def describe(self) -> dict[str, Any]:
        data = dataclasses.asdict(self.config)
        data["ranks_info"] = [r.info for r in self._ranks]
        if self.node is not None:
            data["node_used_bytes"] = self.node.used_bytes()
        if self.tenant is not None:
            data.update(self.tenant.describe())
        return data

    # --- work ---

    def prefill(self, token_ids: list[int]) -> PrefillOutcome:
        with self._lock:
            if not self.healthy():
                raise EngineError(self.problem())
            hit = self.prefix_cache.lookup(token_ids)
            started = time.perf_counter()
            job = {"start_token": hit.cached_tokens, "tokens": len(token_ids) - hit.cached_tokens}
            for rank in self._ranks:
                self._send(rank, ("prefill", job))
            deadline = None  # a 400k-token prefill on a real GPU may take long; a dead rank is noticed
            results: list[RankPrefill] = []
            errors: list[str] = []
            out_of_memory = False
            for rank in self._ranks:  # collect every rank's answer, so no pipe is left out of step
                try:
                    results.append(self._receive(rank, deadline, "prefill"))
                except EngineOutOfMemoryError as exc:
                    out_of_memory = True
                    errors.append(str(exc))
                except EngineError as exc:
                    errors.append(str(exc))
            if out_of_memory:   # as vLLM's engine core: an out-of-memory in a step is fatal
                self._problem = f"out of memory during a prefill of {len(token_ids):,} tokens: {'; '.join(errors)}"
                log.error("lab engine dead: %s", self._problem)
                raise EngineOutOfMemoryError(self._problem)
            if errors:
                raise EngineError("; ".join(errors))
            self.prefix_cache.commit(hit.hashes)
            return PrefillOutcome(len(token_ids), hit.cached_tokens, time.perf_counter() - started, results)

    def decode_seconds(self, tokens: int) -> float:
        # On CUDA the lab has no decoder to time; the model's figure keeps streams realistic anyway.
        return self.cost.decode_s(tokens)

    def reset_prefix_cache(self) -> None:
        self.prefix_cache.reset()

    # --- pipe plumbing ---

    def _send(self, rank: _Rank, message: tuple) -> None:
        try:
            rank.conn.send(message)
        except (OSError, EOFError, BrokenPipeError) as exc:
            self._problem = f"rank {rank.rank} is gone ({exc})"
            raise EngineError(self._problem) from None

    def _receive(self, rank: _Rank, deadline: float | None, what: str) -> Any:
        while True:
            timeout = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            try:
                ready = rank.conn.poll(timeout)
            except (OSError, EOFError):
                ready = True
            if ready:
                try:
                    status, payload = rank.conn.recv()
                except (OSError, EOFError):
                    self._problem = f"rank {rank.rank} (pid {rank.process.pid}) died during {what}"
                    raise EngineError(self._problem) from None
                if status == "out_of_memory":
                    raise EngineOutOfMemoryError(f"rank {rank.rank}: {payload}")
                if status == "error":
                    if what == "start":
                        self._problem = f"rank {rank.rank} failed to start: {payload}"
                    raise EngineError(f"rank {rank.rank}: {payload}")
                return payload
            if not rank.process.is_alive():
                self._problem = (f"rank {rank.rank} (pid {rank.process.pid}) exited with {rank.process.exitcode} "
                                 f"during {what}")
                raise EngineError(self._problem)
            if deadline is not None and time.monotonic() >= deadline:
                self._problem = f"rank {rank.rank} did not answer {what} in time"
                raise EngineError(self._problem)
