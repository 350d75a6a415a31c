"""Facts of vLLM's indexer prefill planner (issue: allocator lab, section 1)."""

from __future__ import annotations

import pytest

from telemetry.model.indexer.planner import chunk_steps, launch_width, plan_launches, plan_prefill, split_rows
from telemetry.model.indexer.shape import MIB, IndexerShape, ShapeError


def test_fixed_width_4608_chunk_is_four_launches_from_the_first_chunk():
    shape = IndexerShape(chunk=4608, compress_ratio=4, max_model_len=409_600)
    assert shape.padded_width == 102_400
    plan = plan_prefill(409_600, shape, "fixed")
    first_step, first_launches = plan[0]
    assert first_step.kv_len == 1152
    assert len(first_launches) == 4
    assert {launch.width for _, launches in plan for launch in launches} == {102_400}
    assert all(len(launches) == 4 for _, launches in plan)
    max_rows = (512 * MIB // 4) // 102_400
    assert [launch.rows for launch in first_launches] == [max_rows] * 3 + [4608 - 3 * max_rows]
    assert all(launch.nbytes <= 512 * MIB for launch in first_launches)


def test_stock_is_one_launch_per_chunk_until_about_116k_tokens():
    shape = IndexerShape(chunk=4608, compress_ratio=4, max_model_len=409_600)
    plan = plan_prefill(4608 * 60, shape, "stock")  # whole chunks only
    single = [step.tokens_so_far for step, launches in plan if len(launches) == 1]
    split = [step.tokens_so_far for step, launches in plan if len(launches) > 1]
    assert single == sorted(single) and split == sorted(split)
    assert max(single) < min(split)
    # 4608 * (tokens / 4) * 4 bytes crosses 512 MiB at 116,508 tokens.
    assert 110_000 < max(single) <= 116_508 < min(split) < 122_000
    assert all(launch.width == step.kv_len for step, launches in plan for launch in launches)


def test_two_small_requests_share_a_stock_launch_but_not_a_fixed_one():
    shape = IndexerShape(max_model_len=409_600)
    shared = plan_launches([(1000, 100), (1000, 100)], shape, "stock")
    assert len(shared) == 1
    assert (shared[0].rows, shared[0].width, shared[0].requests) == (2000, 200, (0, 1))
    apart = plan_launches([(1000, 100), (1000, 100)], shape, "fixed")
    assert [(launch.rows, launch.width, launch.requests) for launch in apart] == [
        (1000, 102_400, (0,)), (1000, 102_400, (1,))]


def test_a_request_over_budget_is_sub_chunked_on_rows():
    shape = IndexerShape(logits_budget_bytes=512 * MIB)
    launches = split_rows(8192, 18_432, shape, "stock")
    assert [launch.rows for launch in launches] == [7281, 911]
    assert all(launch.nbytes <= 512 * MIB for launch in launches)
    # A width beyond the whole budget still gets one row per launch.
    tiny = IndexerShape(logits_budget_bytes=4 * 1024)
    assert [launch.rows for launch in split_rows(3, 5000, tiny, "stock")] == [1, 1, 1]


def test_packing_stops_at_the_kv_workspace():
    launches = plan_launches([(10, 100), (10, 100), (10, 100)], IndexerShape(), "stock", kv_workspace_tokens=250)
    assert [launch.requests for launch in launches] == [(0, 1), (2,)]


def test_chunk_steps_cover_the_prompt_with_a_partial_last_chunk():
    steps = chunk_steps(20_000, 8192, 4)
    assert [(s.start, s.rows, s.tokens_so_far, s.kv_len) for s in steps] == [
        (0, 8192, 8192, 2048),
        (8192, 8192, 16_384, 4096),
        (16_384, 3616, 20_000, 5000),
    ]
    assert chunk_steps(100, 64, 4, start_token=1000)[0].kv_len == (1000 + 64) // 4


def test_fixed_width_never_truncates_a_longer_kv():
    shape = IndexerShape(fixed_width=1000)
    assert launch_width(400, shape, "fixed") == 1000
    assert launch_width(1500, shape, "fixed") == 1500


def test_an_unknown_width_mode_names_the_valid_ones():
    with pytest.raises(ShapeError, match="width mode must be one of stock, fixed, got 'padded'"):
        plan_prefill(8192, IndexerShape(), "padded")  # type: ignore[arg-type]
