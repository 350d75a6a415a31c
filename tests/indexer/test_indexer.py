"""`indexer_logits_launch`: one launch on the simulator, and on CUDA (gpu marker)."""

from __future__ import annotations

import pytest

from telemetry.model.allocsim import CachingAllocatorSim
from telemetry.model.indexer import launch as indexer


def test_simulated_launch_allocates_rows_times_width_float32():
    sim = CachingAllocatorSim()
    handle = indexer.indexer_logits_launch(sim, 8192, 2048, 2048)
    assert sim.allocated_bytes == 8192 * 2048 * 4
    sim.free(handle)
    assert sim.allocated_bytes == 0 and sim.reserved_bytes == 8192 * 2048 * 4


def test_launch_is_looked_up_at_call_time_so_a_hook_sees_it():
    from telemetry.model.indexer.replay import ArmSpec, ReplayParams, replay
    from telemetry.model.indexer.shape import IndexerShape

    calls = []
    original = indexer.indexer_logits_launch

    def wrapped(*args, **kwargs):
        calls.append(args[1:])
        return original(*args, **kwargs)

    indexer.indexer_logits_launch = wrapped
    try:
        replay(ReplayParams(IndexerShape(layers=2), tokens=8192), [ArmSpec("stock")], "sim")
    finally:
        indexer.indexer_logits_launch = original
    assert calls == [(8192, 2048, 2048)] * 2


@pytest.mark.parametrize("rows, width, kv_len", [(-1, 10, 5), (4, 10, 11), (4, 10, -1)])
def test_bad_shapes_are_rejected(rows, width, kv_len):
    with pytest.raises(ValueError, match="kv_len"):
        indexer.indexer_logits_launch(CachingAllocatorSim(), rows, width, kv_len)


@pytest.mark.gpu
def test_cuda_launch_writes_only_the_computed_part():
    import torch

    logits = indexer.indexer_logits_launch("cuda", 64, 1000, 300)
    assert logits.shape == (64, 1000) and logits.dtype == torch.float32 and logits.is_cuda
    assert bool((logits[:, :300] == 1.0).all())
