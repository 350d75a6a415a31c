"""A memory fraction against expandable segments: torch checks the request's segment size, not the pages mapped.

CUDACachingAllocator's `alloc_block` refuses a new segment when `total_allocated_memory + alloc_size` exceeds
`allowed_memory_maximum` (set by `set_per_process_memory_fraction`), where `alloc_size` is the request's whole
segment size, before it knows how many pages an expandable segment must map for it: a request that would only
grow a cached free block at the segment's end by a page or two is refused when the whole request does not fit,
so the cache is freed (pages unmapped) and the call retried. A device that runs out (cuMemCreate failing) counts
only the pages mapped. `memtel tune` predicted the first and measured the second on the H200 (a peak 64 MiB off
under expandable segments); the search now models the cap the probe sets (`Problem.cap`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from telemetry.model.allocsim.simulator import CachingAllocatorSim
from telemetry.model.allocsim.snapshot import read_allocator_state
from telemetry.model.fitsearch.search import Problem, _Counter, _simulate, evaluate
from telemetry.model.fitsearch.space import Setting
from telemetry.model.indexer.shape import MIB, IndexerShape

TOTAL = 1000 * MIB
REPO = Path(__file__).resolve().parents[2]
RECORDED = json.loads((REPO / "tests" / "fixtures" / "tune" / "h200-torch2.11-verify-fit-stock.json").read_text())
SHARED = REPO.parent / "shared" / "data" / "fit-truth" / "fit_stock.json"


def grow_cached_tail(sim: CachingAllocatorSim) -> CachingAllocatorSim:
    sim.free(sim.malloc(100 * MIB))   # 100 MiB mapped (5 pages of 20 MiB), cached at the segment's end
    sim.malloc(150 * MIB)             # grows that free block by 60 MiB, or frees it and maps 160 MiB anew
    return sim


def test_a_fraction_checks_the_whole_request_before_mapping() -> None:
    fraction = grow_cached_tail(CachingAllocatorSim("expandable_segments:True,per_process_memory_fraction:0.2",
                                                    total_memory=TOTAL))
    assert fraction.num_device_free == 1                       # 100 MiB + 150 MiB > 200 MiB: the cache is unmapped
    assert fraction.reserved_bytes == 160 * MIB


def test_a_device_that_runs_out_counts_the_pages_mapped() -> None:
    device = grow_cached_tail(CachingAllocatorSim("expandable_segments:True", capacity_bytes=200 * MIB,
                                                  total_memory=TOTAL))
    assert device.num_device_free == 0                         # 100 MiB + 60 MiB mapped fit in 200 MiB
    assert device.reserved_bytes == 160 * MIB and device.num_device_alloc == 2


@pytest.fixture(scope="module")
def recorded_state():
    if not SHARED.is_file():
        pytest.skip(f"{SHARED} (the shared fit-truth capture) is not beside this clone")
    return read_allocator_state(json.loads(SHARED.read_text())["snapshot"], device=0)


def problem_of(state) -> Problem:
    shape = IndexerShape(layers=4, chunk=8192, compress_ratio=4, max_model_len=1 << 20,
                         logits_budget_bytes=2048 * MIB, topk=2048)
    return Problem(state, shape, RECORDED["limit_bytes"], RECORDED["target_tokens"],
                   total_memory=RECORDED["total_memory"], cap="fraction")


@pytest.mark.parametrize("row", RECORDED["rows"], ids=lambda r: f"{r['alloc_conf'] or 'defaults'}-{r['chunk']}")
def test_tune_predicts_the_h200s_peak_under_its_cap(recorded_state, row: dict) -> None:
    problem = problem_of(recorded_state)
    setting = Setting(row["alloc_conf"], row["budget_mb"] * MIB, row["chunk"], "stock")
    forecast = _simulate(problem, setting, problem.target_tokens, _Counter())
    assert not forecast.out_of_memory and round(forecast.peak_reserved_bytes / MIB) == row["real_peak_mib"]


def test_tune_predicts_the_h200s_longest_fit_today(recorded_state) -> None:
    row = RECORDED["rows"][-1]
    outcome = evaluate(problem_of(recorded_state), Setting(row["alloc_conf"], row["budget_mb"] * MIB, row["chunk"],
                                                           "stock"))
    assert outcome.fit_tokens == row["real_fit"]
