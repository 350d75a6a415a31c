"""The fit budget: how much memory this rank's allocator may still take for a prefill, beyond its live bytes.
Its own room, below the hook's live forecast, `memtel tune` and the lab server, which all read it.

`memtel_forecast_max_prefill_tokens` is the longest prefill whose simulated peak reserved stays within
allocated + budget (telemetry/model/indexer/fit.py); `memtel_forecast_fit_budget_bytes` is the budget. On every
device MEMTEL_GUARD_RESERVE_MB (default 2048) is kept free: other tenants, cuBLAS workspaces and NCCL buffers
allocate outside the forecast.

- unified memory (the device reports itself integrated, or the program's own node, see below): the node's
  headroom, min(MemAvailable, free memory in blocks of at least 2 MiB from /proc/buddyinfo), as the daemon's
  `memtel_node_headroom_without_reclaim_bytes`, less the reserve, divided equally
  among the ranks that share the node's memory (LOCAL_WORLD_SIZE, default 1: tensor-parallel ranks prefill
  the same request at the same time, each with the same growth), plus what this rank's allocator holds free
  (reserved − allocated: already taken from the node, and its own to reuse). A share is not a limit any
  allocator sees: each rank's caching allocator keeps growing its cache while the node has room and frees it
  only when the node is full, so a rank that runs ahead can take more than its share and leave the others
  short. Where ranks share the node, a prefill fits only if the simulated allocator never reserves beyond
  the share, without counting on its cache being freed (`release_cache_on_oom=False`, fit.py);
- a discrete GPU: the device's free memory (cudaMemGetInfo) less the driver's slack (`DRIVER_SLACK_BYTES`:
  memory cudaMemGetInfo counts as free that no allocation gets, BENCHMARKS.md "The driver near a full device"),
  less the reserve, in whole 2 MiB pages (the granularity of the driver's large allocations and of
  cuMemCreate), plus what the allocator holds free.

A program that is its own node (the lab server's emulated unified memory) gives its headroom with
`set_forecast_budget(headroom)`; then the reserve is MEMTEL_GUARD_RESERVE_MB if set, else the program's.
A free figure the hook cannot trust (negative, not a finite number) raises ValueError: the gauge is then absent
for that cycle (counted as a `budget` failure), never a guess.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from telemetry import hook_env
from telemetry.errors import ConfigError

RESERVE_VARIABLE = hook_env.GUARD_RESERVE_MB
DEFAULT_RESERVE_MIB = 2048
MAX_RESERVE_MIB = 1 << 30
RANKS_VARIABLE = "LOCAL_WORLD_SIZE"
MAX_SHARING_RANKS = 1024
MIB = 1 << 20
DRIVER_PAGE_BYTES = 2 * MIB
DRIVER_SLACK_BYTES = 3_735_552   # measured on an H200 (BENCHMARKS.md, "The driver near a full device")
UNIFIED = "unified"
DISCRETE = "discrete"


@dataclass(frozen=True)
class FitBudget:
    """budget_bytes: what the rank may still take beyond its live (allocated) bytes; limit_bytes: the most its
    allocator may reserve in all (allocated + budget), the simulator's capacity; total_memory: the device's total
    (a memory fraction's base; None: unknown); memory: unified or discrete; detail: how it was computed."""

    budget_bytes: int
    limit_bytes: int
    memory: str
    total_memory: int | None
    detail: str
    shared: bool = False   # a share of a node other ranks also take from: the allocator does not see the limit


def reserve_bytes(environ: Mapping[str, str] = os.environ, default_mib: int = DEFAULT_RESERVE_MIB) -> int:
    """MEMTEL_GUARD_RESERVE_MB in bytes (unset or blank: `default_mib`); ConfigError names a bad value."""
    text = environ.get(RESERVE_VARIABLE, "").strip()
    if not text:
        return default_mib * MIB
    if not (text.isascii() and text.isdigit()) or len(text) > 10 or int(text) > MAX_RESERVE_MIB:
        raise ConfigError(f"{RESERVE_VARIABLE}={text[:20]!r}: expected MiB to keep free on the node, an integer in "
                          f"0..{MAX_RESERVE_MIB} (default {DEFAULT_RESERVE_MIB})")
    return int(text) * MIB


def sharing_ranks(environ: Mapping[str, str] = os.environ) -> int:
    """Ranks sharing this node's memory: LOCAL_WORLD_SIZE (torchrun's), else 1; ConfigError names a bad value."""
    text = environ.get(RANKS_VARIABLE, "").strip()
    if not text:
        return 1
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text[:6]) <= MAX_SHARING_RANKS:
        raise ConfigError(f"{RANKS_VARIABLE}={text[:20]!r}: expected the number of ranks on this node, an integer in "
                          f"1..{MAX_SHARING_RANKS}")
    return int(text)


def unified_budget(headroom: int, *, allocated: int, reserved: int, reserve: int, ranks: int,
                   total_memory: int | None = None) -> FitBudget:
    """The budget on unified memory: (headroom − reserve) / ranks + what the allocator holds free."""
    return unified_base(headroom, reserve=reserve, ranks=ranks, total_memory=total_memory).for_allocator(
        allocated, reserved)


def discrete_budget(device_free: int, *, allocated: int, reserved: int, total_memory: int | None,
                    reserve: int = 0, slack: int = DRIVER_SLACK_BYTES) -> FitBudget:
    """The budget on a discrete GPU: the device's free memory less the driver's slack and the reserve, plus what
    the allocator holds free."""
    return discrete_base(device_free, total_memory=total_memory, reserve=reserve, slack=slack).for_allocator(
        allocated, reserved)


def checked_bytes(value: object, what: str) -> int:
    """A memory figure read from the driver or the node, as bytes; ValueError for one the hook cannot trust."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} is {value!r}: expected a number of bytes")
    if (isinstance(value, float) and not math.isfinite(value)) or value < 0:
        raise ValueError(f"{what} is {value!r}: expected a finite, non-negative number of bytes")
    return int(value)


def node_headroom(meminfo_path: str = "/proc/meminfo", buddyinfo_path: str = "/proc/buddyinfo") -> int:
    """min(MemAvailable, free memory in blocks of at least 2 MiB): the daemon's headroom without reclaim.
    OSError / ValueError when the files cannot be read or parsed."""
    from telemetry.procfs.buddyinfo import (
        CONTIGUOUS_BLOCK_BYTES,
        free_bytes_in_blocks_of_at_least,
        parse_buddyinfo,
        system_page_size,
    )
    from telemetry.procfs.headroom import headroom_without_reclaim
    from telemetry.procfs.meminfo import parse_meminfo

    with open(meminfo_path, encoding="ascii", errors="replace") as f:
        meminfo = parse_meminfo(f.read(65536))
    if "MemAvailable" not in meminfo:
        raise ValueError(f"{meminfo_path} has no MemAvailable")
    with open(buddyinfo_path, encoding="ascii", errors="replace") as f:
        zones = parse_buddyinfo(f.read(65536))
    if not zones:
        raise ValueError(f"{buddyinfo_path} has no zone lines")
    contiguous = free_bytes_in_blocks_of_at_least(zones, CONTIGUOUS_BLOCK_BYTES, system_page_size())
    return headroom_without_reclaim(meminfo["MemAvailable"], contiguous)


@dataclass(frozen=True)
class _ProgramBudget:
    headroom: Callable[[], int]
    reserve_mib: int


_lock = threading.Lock()
_program_budget: _ProgramBudget | None = None


def set_forecast_budget(headroom: Callable[[], int] | None, *, reserve_mib: int = DEFAULT_RESERVE_MIB) -> None:
    """This program is its own node of unified memory: `headroom()` returns the bytes its ranks may still take
    together (called from the forecast's thread). reserve_mib: kept free unless MEMTEL_GUARD_RESERVE_MB says
    otherwise. None clears it. Raises ConfigError."""
    global _program_budget
    if headroom is not None and not callable(headroom):
        raise ConfigError(f"the forecast budget's headroom must be a callable returning bytes, got {headroom!r}")
    if isinstance(reserve_mib, bool) or not isinstance(reserve_mib, int) or not 0 <= reserve_mib <= MAX_RESERVE_MIB:
        raise ConfigError(f"reserve_mib must be an integer in 0..{MAX_RESERVE_MIB}, got {reserve_mib!r}")
    with _lock:
        _program_budget = None if headroom is None else _ProgramBudget(headroom, reserve_mib)


@dataclass(frozen=True)
class BudgetBase:
    """The part of the budget read beside the snapshot: this rank's share of the node's headroom less the reserve
    (unified) or the device's free memory (discrete). `for_allocator` adds what the allocator holds free, from the
    same state the simulation starts from. detail: how the base was read (MiB figures)."""

    base_bytes: int
    memory: str
    total_memory: int | None
    detail: str
    shared: bool = False   # the node's headroom is shared by several ranks (see FitBudget)
    fraction: float | None = None   # torch.cuda.set_per_process_memory_fraction's, where below 1 (the allocator's cap)

    def for_allocator(self, allocated: int, reserved: int) -> FitBudget:
        held_free = max(reserved - allocated, 0)
        budget = self.base_bytes + held_free
        return FitBudget(budget, allocated + budget, self.memory, self.total_memory,
                         f"{self.detail}, plus {held_free / MIB:,.0f} MiB held free", self.shared)


def unified_base(headroom: int, *, reserve: int, ranks: int, total_memory: int | None = None,
                 source: str = "node headroom") -> BudgetBase:
    headroom = checked_bytes(headroom, source)
    share = max(headroom - reserve, 0) // max(ranks, 1)
    detail = (f"{source} {headroom / MIB:,.0f} MiB less reserve {reserve / MIB:,.0f} MiB ({RESERVE_VARIABLE})"
              + (f", shared by {ranks} ranks" if ranks > 1 else ""))
    return BudgetBase(share, UNIFIED, total_memory, detail, ranks > 1)


def discrete_base(device_free: int, *, total_memory: int | None, reserve: int = 0,
                  slack: int = DRIVER_SLACK_BYTES) -> BudgetBase:
    """The device's free memory less the driver's slack and the reserve, in whole driver pages (never below 0)."""
    free = checked_bytes(device_free, "the device's free memory (cudaMemGetInfo)")
    usable = max(free - slack - reserve, 0) // DRIVER_PAGE_BYTES * DRIVER_PAGE_BYTES
    detail = (f"device free {free / MIB:,.1f} MiB less the driver's slack {slack / MIB:,.2f} MiB (free memory no "
              f"allocation gets) less reserve {reserve / MIB:,.0f} MiB ({RESERVE_VARIABLE}: other tenants, "
              f"workspaces and buffers allocated outside the forecast), in 2 MiB pages")
    return BudgetBase(usable, DISCRETE, total_memory, detail)


def budget_rule(environ: Mapping[str, str] = os.environ) -> str:
    """What the budget subtracts, for the hook's start-up line (ConfigError for a bad reserve)."""
    program = _program_budget
    reserve = reserve_bytes(environ, DEFAULT_RESERVE_MIB if program is None else program.reserve_mib)
    return (f"fit budget: free memory less {reserve / MIB:,.0f} MiB kept free ({RESERVE_VARIABLE}: other tenants, "
            f"cuBLAS workspaces, NCCL buffers and kernels loaded at their first launch allocate outside the "
            f"forecast); on a discrete GPU also less the driver's slack, {DRIVER_SLACK_BYTES / MIB:,.2f} MiB (free "
            f"memory no allocation gets)")


def read_budget_base(reader: Any, device: int | None, environ: Mapping[str, str] = os.environ) -> BudgetBase | None:
    """The budget's base now; None where there is none to read (an allocator source without
    `set_forecast_budget`). Raises ConfigError for bad settings, OSError / ValueError / RuntimeError where the
    memory cannot be read."""
    program = _program_budget
    ranks = sharing_ranks(environ)
    if program is not None:
        return unified_base(program.headroom(), reserve=reserve_bytes(environ, program.reserve_mib),
                            ranks=ranks, source="the program's node headroom")
    if getattr(reader, "snapshot_source", None) is not None or device is None:
        return None   # an allocator source (not CUDA) that gave no budget
    import torch

    properties = torch.cuda.get_device_properties(device)
    if bool(getattr(properties, "is_integrated", False)):
        return unified_base(node_headroom(), reserve=reserve_bytes(environ), ranks=ranks,
                            total_memory=int(properties.total_memory))
    free, total = torch.cuda.mem_get_info(device)
    base = discrete_base(free, total_memory=checked_bytes(total, "the device's total memory"),
                         reserve=reserve_bytes(environ))
    return replace(base, fraction=process_memory_fraction(torch, device))


def process_memory_fraction(torch: Any, device: int) -> float | None:
    """The cap `torch.cuda.set_per_process_memory_fraction` put on this process's allocator (None: none, or a torch
    that cannot say). A cap in PYTORCH_CUDA_ALLOC_CONF is in the allocator settings the simulator reads already."""
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is None:
        return None
    fraction = float(getter(device))
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"the per-process memory fraction is {fraction!r}: expected a number in (0, 1]")
    return fraction if fraction < 1.0 else None


__all__ = ["DISCRETE", "DRIVER_PAGE_BYTES", "DRIVER_SLACK_BYTES", "RESERVE_VARIABLE", "UNIFIED", "BudgetBase",
           "FitBudget", "budget_rule", "checked_bytes", "discrete_base", "discrete_budget",
           "node_headroom", "process_memory_fraction", "read_budget_base", "reserve_bytes", "set_forecast_budget",
           "sharing_ranks", "unified_base", "unified_budget"]
