"""Which rank this process is, resolved lazily at the first record.

vLLM calls its general plugins before the worker's process group exists, and RANK/LOCAL_RANK are not
in a vLLM worker's environment, so the rank cannot be known at install time. At the first record:
torch.distributed if it is initialized, else an engine's parallel state if it is imported and
initialized (vLLM's or SGLang's world group: SGLang's is a copy of vLLM's, and its local rank is the
scheduler's `gpu_id`), else the RANK/LOCAL_RANK environment variables, else, under `memtel run`, the
process's order among the run's processes that started their hook (telemetry/hook/run_order.py), else 0.
The local rank (the exporter's port offset) is the engine's, else LOCAL_RANK, else the rank.
No engine is imported here: its modules are looked up in sys.modules.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from telemetry import hook_env
from telemetry.engines import ENGINES

# Engines whose world group (`parallel_state._WORLD`, a GroupCoordinator with `rank` and `local_rank`) names
# the rank: the label of the rank's source, and the module (each engine's `world`, telemetry/engines/).
ENGINE_WORLDS = tuple((engine.name, engine.world) for engine in ENGINES if engine.world is not None)
RUN_DIR_ENV = hook_env.RUN_DIR   # set by memtel run (telemetry/hook/run_order.py)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int  # offsets the exporter port, so the ranks of one node never clash
    source: str      # "torch.distributed", "vllm", "sglang", "env", "run order" or "default"


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


def _engine_world() -> tuple[str | None, int | None, int | None]:
    """(engine, rank, local rank) of the first engine whose world group is initialized in this process."""
    for engine, module in ENGINE_WORLDS:
        state = sys.modules.get(module)
        world = getattr(state, "_WORLD", None) if state is not None else None
        if world is None:
            continue
        rank = getattr(world, "rank", None)
        local_rank = getattr(world, "local_rank", None)
        return (engine, int(rank) if isinstance(rank, int) else None,
                int(local_rank) if isinstance(local_rank, int) and local_rank >= 0 else None)
    return None, None, None


_order: tuple[int, str, int | None] | None = None   # (pid, run directory, number) once taken in this process


def run_order(environ: Mapping[str, str] = os.environ, *, take: bool = False) -> int | None:
    """This process's number in its memtel run: taken once per process, when `take` (the hook starts);
    None outside a run or before it is taken."""
    global _order
    directory = environ.get(RUN_DIR_ENV, "")
    if not directory:
        return None
    pid = os.getpid()
    if _order is None or _order[:2] != (pid, directory):
        if not take:
            return None
        from telemetry.hook import run_order as order

        _order = (pid, directory, order.take(directory))
    return _order[2]


def resolve_rank(environ: Mapping[str, str] = os.environ, *, start: bool = False) -> RankInfo:
    """This process's rank. `start`: the hook starts in this process now (the session, once per process):
    under memtel run it takes its number in the run's order then; other calls (a scrape) only read it."""
    rank = _torch_rank()
    source = "torch.distributed"
    engine, engine_rank, engine_local_rank = _engine_world()
    if rank is None and engine_rank is not None and engine is not None:
        rank, source = engine_rank, engine
    env_rank, env_local_rank = _env_int(environ, "RANK"), _env_int(environ, "LOCAL_RANK")
    if rank is None and env_rank is not None:
        rank, source = env_rank, "env"
    if rank is None and env_local_rank is not None:
        rank, source = env_local_rank, "env"
    # Every process of a memtel run that starts takes a number, ranked or not: the unranked ones then
    # come after the ranked ones that started before them, and their ports do not clash.
    order = run_order(environ, take=start)
    if rank is None and order is not None:
        rank, source = order, "run order"
    if rank is None:
        rank, source = 0, "default"
    # The local rank (port offset): the engine knows it; torchrun sets LOCAL_RANK; on one node it is the rank.
    local_rank = next((v for v in (engine_local_rank, env_local_rank) if v is not None), rank)
    return RankInfo(rank, local_rank, source)
