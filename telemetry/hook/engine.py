"""The engine's memory, read from the engine itself: weights, KV cache and CUDA-graph pools per process.

The allocator's counters say how much the process holds, not what for. The engine knows: its model's
parameters are the weights, its KV cache is a list of tensors it allocated once. The hook reads those
tensors (never parses logs), as each engine's module says (telemetry/engines/), when the engine's signals return
(telemetry/hook/presets.py, ENGINE_MEMORY and MODEL_LOADED): after the model loads (weights), after the KV cache
is allocated, and after warm-up (CUDA graphs captured). Bytes are counted per storage, once, however many
tensors view it (vLLM binds one KV tensor to several layers where they share it).

`EngineCollector` exports them with what the process holds now, read at scrape time (the allocator's
reserved and allocated bytes, the device's used bytes where the process has a CUDA context, the process's
resident set), so a ledger (telemetry/ledger) can put them side by side with the node's figures: docs/metrics.md,
"Where the memory is". Everything unknown is absent, never 0. torch is never imported here.

While the engine starts (from vLLM's Worker.init_device or the model-loaded signal until warm-up returns) it
also exports what the start will still take: the engine's own budget (vLLM's requested memory,
gpu_memory_utilization of the device) less what the process holds now. MemtelUnifiedHeadroomFalling and the
daemon's protect action read it: a fall the starting engines explain, ending above the floor, is a start, not a
collapse (docs/alerts.md, "Falling").
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from telemetry.catalogue import described, metrics
from telemetry.engines import ENGINES
from telemetry.hook import allocator
from telemetry.hook.rank import resolve_rank
from telemetry.hook.state import HookState

log = logging.getLogger("memtel.hook")

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class EngineMemory:
    """What the engine allocated, in bytes; None where the engine has not said (yet) or memtel cannot tell."""

    weights_bytes: int | None = None
    kv_cache_bytes: int | None = None
    cuda_graph_pool_bytes: int | None = None
    device: str | None = None   # where the weights live: "cpu", "cuda:0", ...


def _storage_key_and_bytes(tensor: Any) -> tuple[tuple[str, int], int] | None:
    """(device, storage address) and the storage's bytes; None for what is not a tensor with storage."""
    try:
        storage = tensor.untyped_storage()
        return (str(tensor.device), int(storage.data_ptr())), int(storage.nbytes())
    except Exception:
        return None


def storage_bytes(tensors: Iterable[Any]) -> tuple[int, str | None, set[tuple[str, int]]]:
    """Bytes of the distinct storages behind `tensors`, the device of the first one, and the storages' keys."""
    seen: set[tuple[str, int]] = set()
    total = 0
    device: str | None = None
    for tensor in tensors:
        found = _storage_key_and_bytes(tensor)
        if found is None:
            continue
        key, nbytes = found
        if device is None:
            device = key[0]
        if key in seen or key[1] == 0:
            continue
        seen.add(key)
        total += nbytes
    return total, device, seen


def model_of(worker: Any) -> Any:
    """The engine's model: the first that a registered engine's reader finds (vLLM's `worker.get_model()`,
    SGLang's `model` attribute; telemetry/engines/), else None."""
    for engine in ENGINES:
        found = engine.model(worker) if engine.model is not None else None
        if found is not None:
            return found
    return None


def weight_tensors(model: Any) -> list[Any]:
    """The model's parameters (the weights), as the module reports them."""
    parameters = getattr(model, "parameters", None)
    return list(parameters()) if callable(parameters) else []


def kv_cache_tensors(worker: Any) -> list[Any] | None:
    """The KV cache's tensors, as the first registered engine that finds them reads them (vLLM's
    `model_runner.kv_caches`; SGLang's `token_to_kv_pool` buffers). None where no engine finds a KV cache."""
    for engine in ENGINES:
        found = engine.kv_cache(worker) if engine.kv_cache is not None else None
        if found is not None:
            return found
    return None


def private_pool_bytes(segments: Iterable[dict[str, Any]], exclude: set[tuple[str, int]]) -> int:
    """Bytes of the allocator's segments in private pools (pool id other than (0, 0): CUDA graphs' pools),
    leaving out every pool that holds one of the `exclude` storages (a KV cache or weights placed in a pool
    of their own, as vLLM's sleep mode does)."""
    addresses = {address for _, address in exclude}
    by_pool: dict[tuple[int, int], int] = {}
    excluded: set[tuple[int, int]] = set()
    for segment in segments:
        pool = tuple(segment.get("segment_pool_id") or (0, 0))
        if pool == (0, 0):
            continue
        key = (int(pool[0]), int(pool[1]))
        size = int(segment.get("total_size", 0))
        by_pool[key] = by_pool.get(key, 0) + size
        start = int(segment.get("address", 0))
        if any(start <= address < start + size for address in addresses):
            excluded.add(key)
    return sum(size for pool, size in by_pool.items() if pool not in excluded)


# Signals whose return begins the engine's start as memtel reads it (Engine.start_begin: vLLM's worker has its
# memory budget once init_device returns, before the weights load). The vLLM plugin adds them to the
# engine-memory signals, and the hook's exporter starts then, so the start is announced from its beginning.
START_BEGIN_SIGNALS: dict[str, tuple[str, ...]] = {engine.name: engine.start_begin for engine in ENGINES
                                                   if engine.start_begin}
_START_BEGIN_NAMES = tuple(target.partition(":")[2] for targets in START_BEGIN_SIGNALS.values() for target in targets)
# Signals whose return ends the engine's start (Engine.started: vLLM's graphs captured and warmed up; SGLang's
# ModelRunner.initialize does the whole start); the other engine-memory signals (vLLM's initialize_from_config:
# the KV cache) are within it.
STARTED_SIGNALS: tuple[str, ...] = tuple(name for engine in ENGINES for name in engine.started)


def start_plan_bytes(worker: Any, held_bytes: int | None) -> int | None:
    """What the engine will hold once started, as the engine budgets it (Engine.start_plan; vLLM's is the one
    registered: telemetry/engines/vllm.py). None where no engine shows a budget memtel knows how to read."""
    for engine in ENGINES:
        plan = engine.start_plan(worker, held_bytes) if engine.start_plan is not None else None
        if plan is not None:
            return plan
    return None


class EngineTracker:
    """Keeps the engine's memory as its signals report it; thread-safe, never raises into the engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.memory = EngineMemory()
        self._storages: set[tuple[str, int]] = set()
        self.start_plan_bytes: int | None = None  # set when the model loaded; what the start will hold in all
        self.starting = False  # from the model-loaded signal until a STARTED_SIGNALS one returns

    def model_loaded(self, worker: Any) -> None:
        try:
            plan = start_plan_bytes(worker, held_now())
            with self._lock:
                if plan is not None or not self.starting:  # an explicit KV cache size is known only now
                    self.start_plan_bytes, self.starting = plan, plan is not None
        except Exception as error:
            log.debug("memtel: cannot read the engine's memory budget: %r", error)
        self._read_weights(worker)

    def _read_weights(self, worker: Any) -> None:
        try:
            model = model_of(worker)
            if model is None:
                return
            total, device, keys = storage_bytes(weight_tensors(model))
            with self._lock:
                self._storages |= keys
                self.memory = replace(self.memory, weights_bytes=total, device=device)
        except Exception as error:
            log.debug("memtel: cannot read the model's weights: %r", error)

    def engine_signal(self, worker: Any, signal: str = "") -> None:
        """The KV cache is allocated or the CUDA graphs are captured (`signal`: the method's qualified name): read
        both again. Runs in the engine's own thread, so it also binds the allocator reader to the rank's device
        for the scrape-time readings."""
        try:
            allocator.current_reader().read()
        except Exception:
            pass
        if signal.endswith(_START_BEGIN_NAMES):  # the budget is known, the weights not loaded
            try:
                plan = start_plan_bytes(worker, None)
            except Exception:
                plan = None
            with self._lock:
                self.start_plan_bytes, self.starting = plan, plan is not None
            return
        if signal.endswith(STARTED_SIGNALS):
            with self._lock:
                self.starting = False
        try:
            tensors = kv_cache_tensors(worker)
            if tensors is not None:
                total, device, keys = storage_bytes(tensors)
                with self._lock:
                    self._storages |= keys
                    self.memory = replace(self.memory, kv_cache_bytes=total,
                                          device=self.memory.device or device)
            if self.memory.weights_bytes is None:
                self._read_weights(worker)
            pool = self._graph_pool_bytes()
            if pool is not None:
                with self._lock:
                    self.memory = replace(self.memory, cuda_graph_pool_bytes=pool)
        except Exception as error:
            log.debug("memtel: cannot read the engine's KV cache: %r", error)

    def _graph_pool_bytes(self) -> int | None:
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            return None
        with self._lock:
            storages = set(self._storages)
        return private_pool_bytes(torch.cuda.memory_snapshot(), storages)


@dataclass(frozen=True)
class ProcessNow:
    """What the process holds at scrape time."""

    reserved_bytes: int | None
    allocated_bytes: int | None
    device_used_bytes: int | None     # the whole device's used bytes (every process on it)
    device_total_bytes: int | None
    resident_bytes: int | None

    @property
    def held_bytes(self) -> int | None:
        """What counts against the engine's budget: the CUDA allocator's reserved bytes where the process has a
        CUDA device, else its resident set (as vLLM's CPU worker counts what it consumed)."""
        return self.reserved_bytes if self.device_total_bytes is not None else self.resident_bytes


def held_now() -> int | None:
    """ProcessNow.held_bytes, read in the engine's own thread (a signal's return)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        counters = allocator.current_reader().read()
        return None if counters is None else int(counters.reserved_bytes)
    return resident_bytes()


def resident_bytes(statm: str = "/proc/self/statm") -> int | None:
    try:
        with open(statm, "rb") as file:
            return int(file.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


def device_memory(device: int | None) -> tuple[int | None, int | None]:
    """(used, total) of CUDA device `device` (the rank's, as the allocator reader bound it), else Nones.

    Never initialises CUDA, and never asks for the scrape thread's current device (device 0 in a new thread).
    """
    torch = sys.modules.get("torch")
    if device is None or torch is None or not torch.cuda.is_initialized():
        return None, None
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free), int(total)


class EngineCollector(Collector):
    """`memtel_engine_*` on every scrape: the engine's components and what the process holds now.

    Labels `rank`, `node` (as every hook series) and `pid` (to join the daemon's per-process figures).
    """

    def __init__(self, tracker: EngineTracker, state: HookState) -> None:
        self.tracker = tracker
        self.state = state

    def describe(self) -> list[Metric]:
        """The catalogue's engine families: registering never runs collect() (no rank resolved at install)."""
        return described("engine")

    def now(self) -> ProcessNow | None:
        """What the process holds now; None where there is no engine to describe (no engine signal has
        returned and no CUDA allocator is bound): a plain hooked program exports no engine series."""
        reader = allocator.current_reader()
        device = getattr(reader, "bound_device", None)
        memory = self.tracker.memory
        if device is None and memory.weights_bytes is None and memory.kv_cache_bytes is None \
                and not self.tracker.starting and not isinstance(reader, allocator.SourceReader):
            return None   # (an allocator source, such as the lab's simulator, is an engine telling its memory)
        counters = None
        if device is not None:   # a CUDA reader bound in the rank's own thread: ~10 us, the allocator's own lock
            try:
                counters = reader.read()
            except Exception:
                counters = None
        else:   # another source (the lab's simulator) is read only by hooked calls: their last reading
            counters = self.state.previous
        try:
            used, total = device_memory(device)
        except Exception:
            used, total = None, None
        return ProcessNow(
            reserved_bytes=None if counters is None else counters.reserved_bytes,
            allocated_bytes=None if counters is None else counters.allocated_bytes,
            device_used_bytes=used, device_total_bytes=total, resident_bytes=resident_bytes())

    def collect(self) -> Iterator[Metric]:
        rank = str((self.state.rank or resolve_rank()).rank)
        labels = [rank, self.state.node, str(os.getpid())]
        memory = self.tracker.memory
        now = self.now()
        if now is None:
            return
        for family, value in (
            (metrics.ENGINE_WEIGHTS, memory.weights_bytes), (metrics.ENGINE_KV_CACHE, memory.kv_cache_bytes),
            (metrics.ENGINE_CUDA_GRAPH_POOL, memory.cuda_graph_pool_bytes),
            (metrics.ENGINE_ALLOCATOR_RESERVED, now.reserved_bytes),
            (metrics.ENGINE_ALLOCATOR_ALLOCATED, now.allocated_bytes),
            (metrics.ENGINE_DEVICE_USED, now.device_used_bytes), (metrics.ENGINE_DEVICE_TOTAL, now.device_total_bytes),
            (metrics.ENGINE_RESIDENT, now.resident_bytes),
        ):
            if value is not None:
                sample = family.new()
                sample.add_metric(labels, value)
                yield sample
        remaining = self.start_remaining_bytes(now)
        if remaining is not None:
            sample = metrics.ENGINE_START_REMAINING.new()
            sample.add_metric(labels, remaining)
            yield sample

    def start_remaining_bytes(self, now: ProcessNow) -> int | None:
        """While the engine starts: its start's budget less what it holds now (at least 0); else None."""
        tracker = self.tracker
        with tracker._lock:
            starting, plan = tracker.starting, tracker.start_plan_bytes
        held = now.held_bytes
        if not starting or plan is None or held is None:
            return None
        return max(plan - held, 0)


__all__ = ["STARTED_SIGNALS", "START_BEGIN_SIGNALS", "EngineCollector", "EngineMemory", "EngineTracker", "ProcessNow",
           "kv_cache_tensors", "model_of", "private_pool_bytes", "start_plan_bytes", "storage_bytes", "weight_tensors"]
