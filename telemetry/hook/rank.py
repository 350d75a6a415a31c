"""Which rank this process is, resolved lazily at the first record.

vLLM calls its general plugins before the worker's process group exists, and RANK/LOCAL_RANK are not
in a vLLM worker's environment, so the rank cannot be known at install time. At the first record:
torch.distributed if it is initialized, else vLLM's parallel state if it is imported and
initialized, else the RANK/LOCAL_RANK environment variables, else 0. Nothing is imported here:
modules are looked up in sys.modules.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int  # offsets the exporter port, so the ranks of one node never clash
    source: str      # "torch.distributed", "vllm", "env" or "default"


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    try:
        value = int(environ[name])
    except (KeyError, ValueError):
        return None
    return value if value >= 0 else None


def _torch_rank() -> int | None:
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # a half-torn-down process group: fall through to the next source
        return None
    return None


def _vllm_world() -> tuple[int | None, int | None]:
    state = sys.modules.get("vllm.distributed.parallel_state")
    world = getattr(state, "_WORLD", None) if state is not None else None
    if world is None:
        return None, None
    rank = getattr(world, "rank", None)
    local_rank = getattr(world, "local_rank", None)
    return (int(rank) if isinstance(rank, int) else None,
            int(local_rank) if isinstance(local_rank, int) and local_rank >= 0 else None)


def resolve_rank(environ: Mapping[str, str] = os.environ) -> RankInfo:
    rank = _torch_rank()
    source = "torch.distributed"
    vllm_rank, vllm_local_rank = _vllm_world()
    if rank is None and vllm_rank is not None:
        rank, source = vllm_rank, "vllm"
    env_rank, env_local_rank = _env_int(environ, "RANK"), _env_int(environ, "LOCAL_RANK")
    if rank is None and env_rank is not None:
        rank, source = env_rank, "env"
    if rank is None and env_local_rank is not None:
        rank, source = env_local_rank, "env"
    if rank is None:
        rank, source = 0, "default"
    # The local rank (port offset): vLLM knows it; torchrun sets LOCAL_RANK; on one node it is the rank.
    local_rank = next((v for v in (vllm_local_rank, env_local_rank) if v is not None), rank)
    return RankInfo(rank, local_rank, source)
