"""One forecast cycle's simulation, from the allocator's segments: the forecasts and the longest prefill that fits,
now and at best.

At best is the same search on the state with the allocator's cache released (`released_cache`: what
torch.cuda.empty_cache() would give back; live blocks, the KV cache and the weights included, stay), against the
same limit (the budget already counts what the allocator holds free). It costs nothing more where nothing is cached
or the limit now is max-model-len already, and is never below the limit now (a rank that fits a prefill now can).

What the helper process runs for the hook's forecast thread (helper.py), and the thread itself where no helper
can run (in-process). Also the plain-data form of its input and output, for the pipe between them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from telemetry.fit_budget import BudgetBase, FitBudget

if TYPE_CHECKING:
    from telemetry.hook.forecast.workload import ForecastWorkload
    from telemetry.model.indexer.fit import MaxFit
    from telemetry.model.indexer.forecast import Forecast


@dataclass(frozen=True)
class CycleOutput:
    allocated_bytes: int                      # the state's, at the snapshot
    reserved_bytes: int
    forecasts: tuple[Forecast, ...]           # empty when none were asked for
    budget: FitBudget | None
    max_fit: MaxFit | None
    at_best: MaxFit | None = None             # the search with the cache released (None with max_fit)


def run_cycle(segments: Any, device: int | None, workload: ForecastWorkload, conf: str, tokens: tuple[int, ...],
              base: BudgetBase | None, pause: Callable[[], None] | None = None) -> CycleOutput:
    """Read the segments (torch's list, or the native reader's bytes), forecast each length in `tokens`, and search
    the longest prefill within the budget.
    Raises SnapshotError (a ConfigError) for a state the simulator does not model; anything else is a failure
    of the simulation."""
    from telemetry.model.allocsim.snapshot import read_allocator_state, released_cache
    from telemetry.model.indexer.fit import max_prefill_tokens
    from telemetry.model.indexer.forecast import forecast

    if isinstance(segments, bytes):   # the native reader's (SnapshotBytesError where they are not its format)
        from telemetry.hook.forecast.snapshot_native.codec import decode_snapshot

        segments = decode_snapshot(segments)
    state = read_allocator_state(segments, device=device, source="the live allocator", pause=pause)
    counters = state.counters
    forecasts = tuple(forecast(state, workload.shape, n, mode=workload.mode,  # type: ignore[arg-type]
                               alloc_conf=conf, pattern=workload.pattern, pause=pause) for n in tokens)
    budget = max_fit = at_best = None
    if base is not None:
        budget = base.for_allocator(counters.allocated_bytes, counters.reserved_bytes)
        search = functools.partial(max_prefill_tokens, shape=workload.shape, limit_bytes=budget.limit_bytes,
                                   mode=workload.mode,  # type: ignore[arg-type]
                                   alloc_conf=with_fraction(conf, base.fraction),
                                   pattern=workload.pattern, total_memory=budget.total_memory, pause=pause,
                                   release_cache_on_oom=not budget.shared)
        max_fit = at_best = search(state)
        if max_fit.first_misfit is not None:   # below max-model-len: only then is releasing the cache looked at
            emptied = released_cache(state)
            if emptied is not state:
                at_best = max(search(emptied), max_fit, key=lambda fit: fit.tokens)
    return CycleOutput(counters.allocated_bytes, counters.reserved_bytes, forecasts, budget, max_fit, at_best)


def with_fraction(conf: str, fraction: float | None) -> str:
    """The allocator settings with the cap torch reports (`get_per_process_memory_fraction`, set by the settings or by
    `set_per_process_memory_fraction` since; None: the settings as they are)."""
    if fraction is None:
        return conf
    text = repr(fraction) if "e" not in repr(fraction) else f"{fraction:.20f}".rstrip("0")
    kept = [part for part in conf.split(",") if part.strip() and
            part.split(":", 1)[0].strip() != "per_process_memory_fraction"]
    return ",".join([*kept, f"per_process_memory_fraction:{text}"])


# ---- plain data (marshal) for the pipe -----------------------------------------------------------------------

def encode_request(device: int | None, workload: ForecastWorkload, conf: str, tokens: tuple[int, ...],
                   base: BudgetBase | None) -> dict[str, Any]:
    pattern = workload.pattern
    return {"device": device, "shape": workload.shape.as_dict(), "mode": workload.mode, "conf": conf,
            "pattern": None if pattern is None else [pattern.keep_previous, pattern.transient_bytes,
                                                     pattern.row_scale],
            "tokens": list(tokens),
            "base": None if base is None else [base.base_bytes, base.memory, base.total_memory, base.detail,
                                               base.shared, base.fraction]}


def decode_request(doc: dict[str, Any]) -> tuple[int | None, ForecastWorkload, str, tuple[int, ...], BudgetBase | None]:
    from telemetry.hook.forecast.workload import ForecastWorkload
    from telemetry.model.indexer.prefill import LaunchPattern
    from telemetry.model.indexer.shape import IndexerShape

    pattern = None if doc["pattern"] is None else LaunchPattern(*doc["pattern"])
    workload = ForecastWorkload(IndexerShape(**doc["shape"]), doc["mode"], pattern=pattern)
    base = None if doc["base"] is None else BudgetBase(*doc["base"])
    return doc["device"], workload, doc["conf"], tuple(doc["tokens"]), base


def encode_output(output: CycleOutput) -> dict[str, Any]:
    budget, max_fit = output.budget, output.max_fit
    return {"allocated": output.allocated_bytes, "reserved": output.reserved_bytes,
            "forecasts": [{**f.as_json(), "start": list(f.start)} for f in output.forecasts],
            "budget": None if budget is None else [budget.budget_bytes, budget.limit_bytes, budget.memory,
                                                   budget.total_memory, budget.detail, budget.shared],
            "max_fit": None if max_fit is None else max_fit.as_json(),
            "at_best": None if output.at_best is None else output.at_best.as_json()}


def decode_output(doc: dict[str, Any]) -> CycleOutput:
    from telemetry.allocator_counters import AllocatorCounters
    from telemetry.model.indexer.fit import MaxFit
    from telemetry.model.indexer.forecast import Forecast, GrowthStep

    names = [field.name for field in dataclasses.fields(Forecast)]
    forecasts = tuple(Forecast(**{**{name: f[name] for name in names if name in f}, "start": AllocatorCounters(
        *f["start"]), "growth_steps": tuple(GrowthStep(**g) for g in f["growth_steps"])}) for f in doc["forecasts"])
    budget = None if doc["budget"] is None else FitBudget(*doc["budget"])
    max_fit = None if doc["max_fit"] is None else MaxFit(**doc["max_fit"])
    at_best = None if doc.get("at_best") is None else MaxFit(**doc["at_best"])
    return CycleOutput(doc["allocated"], doc["reserved"], forecasts, budget, max_fit, at_best)


__all__ = ["CycleOutput", "decode_output", "decode_request", "encode_output", "encode_request", "run_cycle",
           "with_fraction"]
