"""Where the memory is: the node's and each engine process's ledger lines, from the series memtel exports.

One definition, used by `memtel ledger`, `memtel top` and (written again in PromQL, checked against this on the
same inputs by tests/ledger) the recording rules of dashboards/prometheus/memtel-recording.yml, group
`memtel-ledger`. docs/metrics.md, "Where the memory is", gives the reasoning. A line whose inputs are missing is
None (shown as unknown), never 0.

The node (host memory, bytes):

    used            = MemTotal − MemFree
                    = gpu_processes + page_cache + other_host + unexplained
    page_cache      = Active(file) + Inactive(file)                      the file LRU lists
    unaccounted     = telemetry/procfs/unaccounted.py (no meminfo field holds it)
    gpu_processes   = Σ NVML per-process GPU memory, on unified memory only (there it is host memory, held
                      by the driver outside every meminfo field); None on a discrete GPU or without NVML
    unexplained     = unaccounted − gpu_processes (unaccounted where there is no unified GPU)
    other_host      = used − page_cache − unaccounted                   anonymous memory, kernel, huge pages

A process (an engine's rank, from its hook; bytes):

    weights, kv_cache, cuda_graph_pool    what the engine allocated (telemetry/hook/engine.py)
    live_other      = allocated − weights − kv_cache       activations, workspaces, other live tensors
    allocator_cache = reserved − allocated                 the caching allocator's free blocks
    outside         = process GPU memory − reserved        CUDA context, NCCL, cuBLAS, other libraries
    host_rss        = the process's resident set

`outside` takes the process's GPU memory from NVML's per-process figure (the daemon's, joined by node and pid);
where NVML lists no such process (a container without the host's PID namespace, for one) it falls back to the
device's used bytes, which counts every process on the device: an upper bound, marked as such.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

NODE_LINES = ("gpu_processes", "page_cache", "other_host", "unexplained")
PROCESS_LINES = ("weights", "kv_cache", "cuda_graph_pool", "live_other", "allocator_cache", "outside", "host_rss")


def _minus(a: int | None, *others: int | None) -> int | None:
    if a is None or any(o is None for o in others):
        return None
    return a - sum(o for o in others if o is not None)


@dataclass(frozen=True)
class NodeLedger:
    total: int | None
    used: int | None
    gpu_processes: int | None
    page_cache: int | None
    other_host: int | None
    unexplained: int | None
    unified: bool | None          # None: no NVML answer (a CPU box, or no driver)

    @classmethod
    def from_values(cls, *, mem_total: int | None, mem_free: int | None, active_file: int | None,
                    inactive_file: int | None, unaccounted: int | None, gpu_process_bytes: list[int] | None,
                    unified: bool | None) -> NodeLedger:
        used = _minus(mem_total, mem_free)
        page_cache = None if active_file is None or inactive_file is None else active_file + inactive_file
        gpu = sum(gpu_process_bytes) if unified and gpu_process_bytes else None
        unexplained = unaccounted if gpu is None else _minus(unaccounted, gpu)
        other_host = _minus(used, page_cache, unaccounted)
        return cls(total=mem_total, used=used, gpu_processes=gpu, page_cache=page_cache, other_host=other_host,
                   unexplained=unexplained, unified=unified)

    def lines(self) -> dict[str, int | None]:
        return {name: getattr(self, name) for name in NODE_LINES}

    def adds_up(self) -> bool:
        """The lines sum to `used` (where every line is known)."""
        parts = [v for k, v in self.lines().items() if not (k == "gpu_processes" and v is None)]
        return self.used is not None and None not in parts and sum(p for p in parts if p is not None) == self.used


@dataclass(frozen=True)
class ProcessLedger:
    rank: str
    pid: str
    weights: int | None
    kv_cache: int | None
    cuda_graph_pool: int | None
    live_other: int | None
    allocator_cache: int | None
    outside: int | None
    outside_basis: str | None      # "nvml_process" or "device_used" (every process on the device: an upper bound)
    host_rss: int | None
    reserved: int | None
    allocated: int | None

    @classmethod
    def from_values(cls, *, rank: str, pid: str, weights: int | None, kv_cache: int | None,
                    cuda_graph_pool: int | None, reserved: int | None, allocated: int | None,
                    nvml_process_bytes: int | None, device_used_bytes: int | None,
                    host_rss: int | None) -> ProcessLedger:
        outside, basis = None, None
        if nvml_process_bytes is not None and reserved is not None:
            outside, basis = nvml_process_bytes - reserved, "nvml_process"
        elif device_used_bytes is not None and reserved is not None:
            outside, basis = device_used_bytes - reserved, "device_used"
        return cls(rank=rank, pid=pid, weights=weights, kv_cache=kv_cache, cuda_graph_pool=cuda_graph_pool,
                   live_other=_minus(allocated, weights, kv_cache), allocator_cache=_minus(reserved, allocated),
                   outside=outside, outside_basis=basis, host_rss=host_rss, reserved=reserved, allocated=allocated)

    def as_dict(self) -> dict[str, Any]:
        """For `--json`: rank and pid as numbers (null where the hook's label is no decimal number)."""
        return {**asdict(self), "rank": label_number(self.rank), "pid": label_number(self.pid)}


def label_number(text: str) -> int | None:
    """A label that counts (a rank, a pid) as a number; None for anything else a hostile endpoint may send."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 10 else None


__all__ = ["NODE_LINES", "PROCESS_LINES", "NodeLedger", "ProcessLedger"]
