"""The at-best limit (`memtel_forecast_max_prefill_tokens_at_best`): the live search run again on the state with
the allocator's cache released, against the same limit, and exported beside the limit now.

On the simulator source (as the lab server's ranks): a rank whose cache holds small-pool segments a long prefill
cannot use, on a node it shares (the search may not count on its cache being freed): the gauge is the search on
`released_cache(state)` with the same limit, above the limit now; with nothing cached it is the limit now, from
the one search. The helper process's answer carries it across the pipe.
"""

from __future__ import annotations

import marshal

from prometheus_client import CollectorRegistry

from telemetry.catalogue.metrics import FORECAST_MAX_PREFILL_TOKENS, FORECAST_MAX_PREFILL_TOKENS_AT_BEST
from telemetry.fit_budget import set_forecast_budget
from telemetry.hook import set_allocator_source
from telemetry.hook.forecast import set_forecast_workload
from telemetry.hook.forecast.collector import ForecastCollector
from telemetry.hook.forecast.compute import CycleOutput, decode_output, encode_output
from telemetry.hook.forecast.runner import Forecaster
from telemetry.hook.state import HookState
from telemetry.model.allocsim.snapshot import read_allocator_state, released_cache
from telemetry.model.indexer.backends import SimBackend
from telemetry.model.indexer.fit import MaxFit, max_prefill_tokens
from telemetry.model.indexer.prefill import run_prefill
from telemetry.model.indexer.shape import MIB, IndexerShape

SHAPE = IndexerShape(layers=4, chunk=1024, compress_ratio=4, max_model_len=65536, logits_budget_bytes=64 * MIB)
SHARED = {"LOCAL_WORLD_SIZE": "2"}   # two ranks share the node: the search may not count on freeing the cache


def rank(cached_small: int) -> SimBackend:
    """A simulated rank that served one prefill and holds a live tensor; `cached_small` 1 MiB tensors were freed,
    leaving their 2 MiB small-pool segments cached (no logits block fits there)."""
    backend = SimBackend("")
    run_prefill(backend, SHAPE, "stock", 3000)
    backend.alloc(3 * MIB)
    small = [backend.alloc(MIB) for _ in range(cached_small)]
    for allocation in small:
        backend.release(allocation)
    set_allocator_source(backend.counters, snapshot=backend.snapshot)
    set_forecast_workload(SHAPE)
    return backend


def run(environ: dict[str, str]) -> Forecaster:
    live = Forecaster((4096,), 5.0, environ=environ, helper=False)
    try:
        assert live.run_once()
    finally:
        live.stop()
    return live


def gauges(live: Forecaster) -> dict[str, float | None]:
    registry = CollectorRegistry()
    registry.register(ForecastCollector(live, HookState(node="n1", targets={})))
    labels = {"rank": "0", "node": "n1"}
    return {entry.series: registry.get_sample_value(entry.series, labels)
            for entry in (FORECAST_MAX_PREFILL_TOKENS, FORECAST_MAX_PREFILL_TOKENS_AT_BEST)}


def test_the_at_best_gauge_is_the_search_with_the_cache_released_and_the_same_limit():
    backend = rank(cached_small=40)
    set_forecast_budget(lambda: 190 * MIB, reserve_mib=0)
    live = run(SHARED)
    results = live.results
    state = read_allocator_state(backend.snapshot())
    emptied = released_cache(state)
    assert emptied.counters.reserved_bytes < state.counters.reserved_bytes   # the rank holds a cache to release
    limit = results.budget.limit_bytes
    expected = max_prefill_tokens(emptied, SHAPE, limit_bytes=limit, release_cache_on_oom=False)
    assert results.at_best == expected and results.at_best.limit_bytes == results.max_fit.limit_bytes
    assert results.max_fit.tokens < expected.tokens < SHAPE.max_model_len   # both bite: the comparison means something
    exported = gauges(live)
    assert exported[FORECAST_MAX_PREFILL_TOKENS.series] == results.max_fit.tokens
    assert exported[FORECAST_MAX_PREFILL_TOKENS_AT_BEST.series] == expected.tokens


def test_with_nothing_to_release_at_best_is_the_limit_now_from_one_search():
    backend = SimBackend("")
    backend.alloc(3 * MIB)   # resident memory only, nothing cached
    set_allocator_source(backend.counters, snapshot=backend.snapshot)
    set_forecast_workload(SHAPE)
    set_forecast_budget(lambda: 190 * MIB, reserve_mib=0)
    results = run(SHARED).results
    assert results.max_fit.tokens < SHAPE.max_model_len and results.at_best is results.max_fit


def test_no_budget_no_at_best_gauge():
    rank(cached_small=40)
    live = run({})
    assert live.results.at_best is None
    assert gauges(live)[FORECAST_MAX_PREFILL_TOKENS_AT_BEST.series] is None   # absent, never a 0


def test_the_helper_process_answer_carries_it():
    fit = MaxFit(tokens=5000, max_tokens=65536, limit_bytes=1 << 30, start_reserved_bytes=1 << 28,
                 peak_reserved_bytes=1 << 29, first_misfit=5001, simulations=7)
    best = MaxFit(**{**fit.as_json(), "tokens": 9000, "first_misfit": 9001})
    output = CycleOutput(1, 2, (), None, fit, best)
    assert decode_output(marshal.loads(marshal.dumps(encode_output(output)))) == output
