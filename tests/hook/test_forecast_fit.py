"""The live forecast's longest prefill that fits: its budget, its search in the helper process, its failures.

On the simulator source (as the lab server's ranks): the exported `memtel_forecast_max_prefill_tokens` equals
the search run directly on the same state with the same limit; the budget is the node's headroom less the
reserve, shared by the node's ranks, plus what the allocator holds free; no budget, a budget that cannot be
read and a helper that dies are each said and counted, and the forecasts stay. And issue 19 item 9: where the
forecast cannot run (a CUDA reader without a CUDA device), it says once why it is off and counts it.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from telemetry.errors import ConfigError
from telemetry.fit_budget import (
    DISCRETE,
    UNIFIED,
    discrete_base,
    discrete_budget,
    node_headroom,
    read_budget_base,
    reserve_bytes,
    set_forecast_budget,
    sharing_ranks,
    unified_base,
    unified_budget,
)
from telemetry.hook import allocator, set_allocator_source
from telemetry.hook.forecast import set_forecast_workload
from telemetry.hook.forecast.compute import decode_request, encode_request, with_fraction
from telemetry.hook.forecast.helper import ForecastHelper
from telemetry.hook.forecast.runner import BUDGET, SIMULATION, UNAVAILABLE, Forecaster
from telemetry.hook.forecast.workload import make_workload
from telemetry.model.allocsim.config import parse_alloc_conf
from telemetry.model.allocsim.snapshot import read_allocator_state
from telemetry.model.indexer.backends import SimBackend
from telemetry.model.indexer.fit import max_prefill_tokens
from telemetry.model.indexer.prefill import run_prefill
from telemetry.model.indexer.shape import MIB, IndexerShape
from telemetry.procfs.buddyinfo import CONTIGUOUS_BLOCK_BYTES, free_bytes_in_blocks_of_at_least, parse_buddyinfo
from telemetry.procfs.meminfo import parse_meminfo

PROC = Path(__file__).resolve().parents[1] / "fixtures" / "proc"
SHAPE = IndexerShape(layers=4, chunk=1024, compress_ratio=4, max_model_len=65536, logits_budget_bytes=64 * MIB)
GIB = 1 << 30


def sim_rank(warm_tokens: int = 3000) -> SimBackend:
    """A simulated rank that served one prefill and holds one live tensor, behind the hook's allocator source."""
    backend = SimBackend("")
    run_prefill(backend, SHAPE, "stock", warm_tokens)
    backend.alloc(3 * MIB)
    set_allocator_source(backend.counters, snapshot=backend.snapshot)
    set_forecast_workload(SHAPE)
    return backend


def forecaster(environ: dict[str, str] | None = None, **kwargs) -> Forecaster:
    return Forecaster((4096,), 5.0, environ=environ or {}, **kwargs)


# ---- the budget --------------------------------------------------------------------------------------------


def test_unified_memory_is_shared_equally_by_the_nodes_ranks_plus_what_each_holds_free():
    one = unified_budget(10 * GIB, allocated=1 * GIB, reserved=3 * GIB, reserve=2 * GIB, ranks=1)
    two = unified_budget(10 * GIB, allocated=1 * GIB, reserved=3 * GIB, reserve=2 * GIB, ranks=2)
    assert (one.budget_bytes, one.memory) == (8 * GIB + 2 * GIB, UNIFIED)
    assert two.budget_bytes == 4 * GIB + 2 * GIB and two.limit_bytes == 1 * GIB + two.budget_bytes
    assert "shared by 2 ranks" in two.detail
    assert two.shared and not one.shared   # a share no allocator sees: the search may not count on freeing cache
    # Below the reserve nothing is left to share, but a rank may still reuse what it holds free.
    assert unified_budget(GIB, allocated=0, reserved=MIB, reserve=2 * GIB, ranks=2).budget_bytes == MIB


def test_a_discrete_gpu_gives_its_free_memory_less_the_driver_slack_and_the_reserve_plus_what_is_held_free():
    # 5 GiB free less the driver's 3,735,552 B slack: 5,116 MiB in whole 2 MiB pages (test_fit_edge_truth.py).
    budget = discrete_budget(5 * GIB, allocated=2 * GIB, reserved=2 * GIB + 7 * MIB, total_memory=80 * GIB)
    assert (budget.budget_bytes, budget.limit_bytes, budget.memory) == (5116 * MIB + 7 * MIB, 7 * GIB + 3 * MIB,
                                                                        DISCRETE)
    reserved = discrete_budget(5 * GIB, allocated=2 * GIB, reserved=2 * GIB, total_memory=80 * GIB, reserve=2 * GIB)
    assert reserved.budget_bytes == 3068 * MIB
    assert "slack 3.56 MiB" in reserved.detail and "less reserve 2,048 MiB (MEMTEL_GUARD_RESERVE_MB" in reserved.detail
    assert discrete_budget(MIB, allocated=0, reserved=0, total_memory=GIB, reserve=2 * GIB).budget_bytes == 0


def test_the_start_up_line_says_what_the_budget_subtracts_and_why():
    sim_rank()
    line = forecaster(helper=False).describe()
    assert "less 2,048 MiB kept free (MEMTEL_GUARD_RESERVE_MB: other tenants, cuBLAS workspaces" in line
    assert "on a discrete GPU also less the driver's slack, 3.56 MiB" in line
    assert "less 512 MiB kept free" in forecaster({"MEMTEL_GUARD_RESERVE_MB": "512"}, helper=False).describe()
    set_forecast_budget(lambda: GIB, reserve_mib=0)   # a program that is its own node: its reserve
    assert "less 0 MiB kept free" in forecaster(helper=False).describe()


@pytest.mark.parametrize("free", [-1, float("nan"), float("inf"), -0.5, None, "5"])
def test_a_free_figure_the_hook_cannot_trust_is_refused_never_guessed(free):
    with pytest.raises(ValueError, match=r"expected .*bytes"):
        discrete_base(free, total_memory=GIB)
    with pytest.raises(ValueError, match=r"expected .*bytes"):
        unified_base(free, reserve=0, ranks=1)


def fake_cuda(monkeypatch, *, free, total=80 * GIB, integrated=False, fraction=1.0, fails=False):
    """torch.cuda's device queries as a discrete or integrated GPU would answer them (no GPU here)."""
    torch = pytest.importorskip("torch")

    def mem_get_info(device):
        if fails:
            raise RuntimeError("CUDA error: unspecified launch failure")
        return free, total

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("P", (), {"is_integrated": integrated, "total_memory": total})())
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: fraction)


def test_on_a_discrete_gpu_the_reserve_is_taken_off_too_and_a_memory_fraction_is_read(monkeypatch):
    fake_cuda(monkeypatch, free=10 * GIB)
    reader = allocator.CudaAllocatorReader()
    base = read_budget_base(reader, 0, environ={})
    assert base.memory == DISCRETE and base.fraction is None
    assert base.base_bytes == 10 * GIB - 2048 * MIB - 4 * MIB   # the default reserve and the slack, in pages
    assert read_budget_base(reader, 0, environ={"MEMTEL_GUARD_RESERVE_MB": "0"}).base_bytes == 10 * GIB - 4 * MIB
    fake_cuda(monkeypatch, free=10 * GIB, fraction=0.25)
    capped = read_budget_base(reader, 0, environ={})
    assert capped.fraction == 0.25   # and it reaches the helper process
    assert decode_request(encode_request(0, make_workload(SHAPE), "", (), capped))[4] == capped
    assert with_fraction("expandable_segments:True", 0.25) == \
        "expandable_segments:True,per_process_memory_fraction:0.25"
    assert with_fraction("per_process_memory_fraction:0.5,expandable_segments:True", 0.25) == \
        "expandable_segments:True,per_process_memory_fraction:0.25"   # torch's current cap wins
    assert with_fraction("max_split_size_mb:256", None) == "max_split_size_mb:256"
    assert parse_alloc_conf(with_fraction("", 1e-05)).per_process_memory_fraction == 1e-05


@pytest.mark.parametrize("problem", [{"free": float("nan")}, {"free": -4096}, {"free": GIB, "fails": True}])
def test_a_driver_that_fails_or_answers_nonsense_makes_the_budget_unreadable(monkeypatch, problem):
    fake_cuda(monkeypatch, **problem)
    with pytest.raises((ValueError, RuntimeError)):
        read_budget_base(allocator.CudaAllocatorReader(), 0, environ={})


def test_the_reserve_and_the_ranks_are_read_from_the_environment_or_refused_in_one_line():
    assert reserve_bytes({}) == 2048 * MIB and reserve_bytes({"MEMTEL_GUARD_RESERVE_MB": " 512 "}) == 512 * MIB
    assert reserve_bytes({}, default_mib=0) == 0 and sharing_ranks({}) == 1
    assert sharing_ranks({"LOCAL_WORLD_SIZE": "4"}) == 4
    for bad in ("2G", "-1", "1.5", "９"):
        with pytest.raises(ConfigError, match=r"MEMTEL_GUARD_RESERVE_MB=.*expected MiB"):
            reserve_bytes({"MEMTEL_GUARD_RESERVE_MB": bad})
    for bad in ("0", "two", "100000"):
        with pytest.raises(ConfigError, match=r"LOCAL_WORLD_SIZE=.*expected the number of ranks"):
            sharing_ranks({"LOCAL_WORLD_SIZE": bad})


def test_the_node_headroom_is_the_daemons_min_of_memavailable_and_contiguous_free_memory():
    meminfo, buddyinfo = PROC / "meminfo.x86_64-debian12-24g-with-buddyinfo", PROC / "buddyinfo.x86_64-debian12-24g"
    available = parse_meminfo(meminfo.read_text())["MemAvailable"]
    contiguous = free_bytes_in_blocks_of_at_least(parse_buddyinfo(buddyinfo.read_text()), CONTIGUOUS_BLOCK_BYTES,
                                                  4096)
    assert node_headroom(str(meminfo), str(buddyinfo)) == min(available, contiguous)


# ---- the live search -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("helper", [True, False])
def test_the_exported_answer_is_the_search_on_the_same_state_with_the_shared_budget(helper):
    backend = sim_rank()
    set_forecast_budget(lambda: 160 * MIB, reserve_mib=20)
    live = forecaster({"LOCAL_WORLD_SIZE": "2"}, helper=helper)
    try:
        assert live.run_once()
    finally:
        live.stop()
    results = live.results
    state = read_allocator_state(backend.snapshot())
    counters = state.counters
    held_free = counters.reserved_bytes - counters.allocated_bytes
    assert results.budget.budget_bytes == (160 - 20) * MIB // 2 + held_free
    limit = counters.allocated_bytes + results.budget.budget_bytes
    expected = max_prefill_tokens(state, SHAPE, limit_bytes=limit, release_cache_on_oom=False)
    assert results.max_fit == expected
    assert 0 < expected.tokens < SHAPE.max_model_len   # the limit cuts the range: the comparison means something
    # Alone on the node the rank could free its cache to stay within the limit; sharing it, it cannot count on that.
    alone = max_prefill_tokens(state, SHAPE, limit_bytes=limit)
    assert expected.tokens <= alone.tokens and expected.peak_reserved_bytes <= limit
    assert results.forecasts and results.forecasts[0].tokens == 4096
    assert (results.helper_cpu_seconds > 0) == helper


def test_a_changed_budget_searches_again_from_the_same_state_and_the_same_one_does_not():
    sim_rank()
    room = [100 * MIB]
    set_forecast_budget(lambda: room[0], reserve_mib=0)
    live = forecaster()
    asked = []
    helper = live._helper
    real = helper.cycle
    helper.cycle = lambda request, *a: asked.append(request) or real(request, *a)  # type: ignore[method-assign]
    try:
        assert live.run_once() and live.run_once()
        first = live.results.max_fit
        assert len(asked) == 1                       # unchanged state, unchanged budget: nothing simulated
        room[0] = 60 * MIB
        assert live.run_once()
        assert len(asked) == 2 and asked[1]["tokens"] == []   # the search alone, the forecasts stand
        assert live.results.max_fit.tokens < first.tokens
    finally:
        live.stop()


def test_without_a_budget_the_forecast_runs_and_the_gauge_is_left_out_with_one_line(caplog):
    sim_rank()
    live = forecaster()
    try:
        with caplog.at_level(logging.INFO, logger="memtel.hook"):
            assert live.run_once() and live.run_once()
    finally:
        live.stop()
    assert live.results.forecasts and live.results.max_fit is None and live.results.budget is None
    assert len([r for r in caplog.records if "no fit budget" in r.getMessage()]) == 1


@pytest.mark.parametrize("bad", [float("nan"), -1])
def test_an_untrusted_budget_leaves_the_gauge_out_counted_every_cycle_and_said_once(bad, caplog):
    sim_rank()
    room = [bad]
    set_forecast_budget(lambda: room[0], reserve_mib=0)
    live = forecaster(helper=False)
    try:
        with caplog.at_level(logging.INFO, logger="memtel"):
            assert live.run_once() and live.run_once() and live.run_once()
            assert live.results.failures == {BUDGET: 3}
            assert live.results.max_fit is None and live.results.budget is None and live.results.forecasts
            room[0] = 200 * MIB
            assert live.run_once() and live.results.max_fit is not None   # the gauge is back with the budget
    finally:
        live.stop()
    said = [r.getMessage() for r in caplog.records]
    failing = [m for m in said if "cannot read the fit budget" in m]
    assert len(failing) == 1 and "expected a finite, non-negative number of bytes" in failing[0]
    assert len([m for m in said if "can be read again" in m]) == 1


def test_a_budget_that_cannot_be_read_is_counted_and_the_forecasts_stay():
    sim_rank()
    set_forecast_budget(lambda: 1 // 0)
    live = forecaster()
    try:
        assert live.run_once()
    finally:
        live.stop()
    assert live.results.failures == {BUDGET: 1} and live.results.forecasts and live.results.max_fit is None


def test_a_helper_that_dies_is_counted_and_the_next_cycle_starts_another():
    sim_rank()
    set_forecast_budget(lambda: 300 * MIB)
    live = forecaster()
    live._helper = ForecastHelper(command=[sys.executable, "-c", "pass"])   # exits at once, answers nothing
    assert not live.run_once()
    assert live.results.failures == {SIMULATION: 1} and not live.results.forecasts
    live._helper = ForecastHelper()
    try:
        assert live.run_once() and live.results.max_fit is not None
    finally:
        live.stop()
    assert live._helper._process is None   # stop() ended the helper


# ---- issue 19 item 9: a forecast that cannot run says so --------------------------------------------------------


def test_a_forecast_that_cannot_run_says_once_why_it_is_off_and_counts_it(caplog):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the forecast can run")
    set_forecast_workload(SHAPE)
    live = Forecaster((100_000,), 5.0, reader=lambda: allocator.CudaAllocatorReader(), environ={})
    assert live.describe().startswith("off (no CUDA device in this process")
    with caplog.at_level(logging.WARNING, logger="memtel.hook"):
        assert not live.run_once() and not live.run_once()
    assert live.results.failures == {UNAVAILABLE: 2}
    lines = [r.getMessage() for r in caplog.records if "live forecast off" in r.getMessage()]
    assert len(lines) == 1 and "no CUDA device" in lines[0] and "reason='unavailable'" in lines[0]
