"""How a memory limit stops the allocator, as `memtel tune` and `memtel forecast` both take it (`--cap`).

"device": the memory runs out (cudaMalloc fails, or cuMemCreate for an expandable segment's pages: the pages
mapped count); the simulator gets the limit as its capacity. "fraction": torch's per-process memory fraction
(`set_per_process_memory_fraction`, what `memtel tune --verify` on CUDA sets), checked before each new segment
against the request's segment size, not the pages an expandable segment maps for it; the simulator gets the
limit as `per_process_memory_fraction` of the total memory (the device's; an H200's when unknown), with the
device itself as its capacity.
"""

from __future__ import annotations

import dataclasses

from telemetry.errors import ConfigError

from .config import format_alloc_conf, parse_alloc_conf
from .simulator import DEFAULT_TOTAL_MEMORY

CAPS = ("device", "fraction")


def capped(alloc_conf: str, limit_bytes: int, cap: str, total_memory: int | None) -> tuple[str, int, int | None]:
    """(allocator settings, capacity bytes, total memory) that make the simulator stop where `cap` stops the
    allocator at `limit_bytes` (module docstring)."""
    if cap not in CAPS:
        raise ConfigError(f"the cap must be {' or '.join(CAPS)}, got {cap!r}")
    if cap == "device":
        return alloc_conf, limit_bytes, total_memory
    total = total_memory or DEFAULT_TOTAL_MEMORY
    fraction = min(limit_bytes / total, 1.0)
    conf = dataclasses.replace(parse_alloc_conf(alloc_conf), per_process_memory_fraction=fraction)
    return format_alloc_conf(conf), total, total


__all__ = ["CAPS", "capped"]
