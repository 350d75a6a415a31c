"""The engine's memory, read from the engine itself: weights, KV cache and CUDA-graph pools per process.

The allocator's counters say how much the process holds, not what for. The engine knows: its model's
parameters are the weights, its KV cache is a list of tensors it allocated once. The hook reads those
tensors (never parses logs) when the engine's signals return (telemetry/hook/presets.py, ENGINE_MEMORY and
MODEL_LOADED): after the model loads (weights), after the KV cache is allocated, and after warm-up (CUDA
graphs captured). Bytes are counted per storage, once, however many tensors view it (vLLM binds one KV
tensor to several layers where they share it).

`EngineCollector` exports them with what the process holds now, read at scrape time (the allocator's
reserved and allocated bytes, the device's used bytes where the process has a CUDA context, the process's
resident set), so a ledger (telemetry/ledger) can put them side by side with the node's figures: docs/metrics.md,
"Where the memory is". Everything unknown is absent, never 0. torch is never imported here.
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

from telemetry.catalogue import metrics
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


def _flatten(value: Any, depth: int = 0) -> Iterator[Any]:
    """Tensors in a tensor, list, tuple or dict of them (vLLM: list of tensors; some backends nest)."""
    if depth > 4 or value is None:
        return
    if isinstance(value, dict):
        for item in value.values():
            yield from _flatten(item, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _flatten(item, depth + 1)
    elif hasattr(value, "untyped_storage"):
        yield value


def model_of(worker: Any) -> Any:
    """The engine's model: vLLM's `worker.get_model()`, else a `model` attribute (SGLang's ModelRunner)."""
    get_model = getattr(worker, "get_model", None)
    if callable(get_model):
        return get_model()
    runner = getattr(worker, "model_runner", None)
    return getattr(worker, "model", None) or getattr(runner, "model", None)


def weight_tensors(model: Any) -> list[Any]:
    """The model's parameters (the weights), as the module reports them."""
    parameters = getattr(model, "parameters", None)
    return list(parameters()) if callable(parameters) else []


def kv_cache_tensors(worker: Any) -> list[Any] | None:
    """The KV cache's tensors: vLLM's `model_runner.kv_caches`; SGLang's `token_to_kv_pool` buffers.

    None where this worker shows no KV cache memtel knows how to read.
    """
    runner = getattr(worker, "model_runner", worker)
    caches = getattr(runner, "kv_caches", None)
    if caches:
        return list(_flatten(caches))
    pool = getattr(runner, "token_to_kv_pool", None)
    if pool is not None:
        buffers = [getattr(pool, name, None) for name in ("k_buffer", "v_buffer", "kv_buffer")]
        tensors = list(_flatten([b for b in buffers if b is not None]))
        return tensors or None
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


class EngineTracker:
    """Keeps the engine's memory as its signals report it; thread-safe, never raises into the engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.memory = EngineMemory()
        self._storages: set[tuple[str, int]] = set()

    def model_loaded(self, worker: Any) -> None:
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

    def engine_signal(self, worker: Any) -> None:
        """The KV cache is allocated or the CUDA graphs are captured: read both again. Runs in the engine's own
        thread, so it also binds the allocator reader to the rank's device for the scrape-time readings."""
        try:
            allocator.current_reader().read()
        except Exception:
            pass
        try:
            tensors = kv_cache_tensors(worker)
            if tensors is not None:
                total, device, keys = storage_bytes(tensors)
                with self._lock:
                    self._storages |= keys
                    self.memory = replace(self.memory, kv_cache_bytes=total,
                                          device=self.memory.device or device)
            if self.memory.weights_bytes is None:
                self.model_loaded(worker)
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

    def describe(self) -> Iterator[Metric]:
        return iter(())   # names only: registering never runs collect() (no rank resolved at install)

    def now(self) -> ProcessNow | None:
        """What the process holds now; None where there is no engine to describe (no engine signal has
        returned and no CUDA allocator is bound): a plain hooked program exports no engine series."""
        reader = allocator.current_reader()
        device = getattr(reader, "bound_device", None)
        memory = self.tracker.memory
        if device is None and memory.weights_bytes is None and memory.kv_cache_bytes is None:
            return None
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


__all__ = ["EngineCollector", "EngineMemory", "EngineTracker", "ProcessNow", "kv_cache_tensors", "model_of",
           "private_pool_bytes", "storage_bytes", "weight_tensors"]
