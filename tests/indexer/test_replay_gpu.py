"""`memtel replay --allocator cuda` on a real GPU (device machine only: marker gpu)."""

from __future__ import annotations

import pytest

from telemetry.model.indexer.prefill import LaunchPattern
from telemetry.model.indexer.replay import ArmSpec, ReplayParams, replay
from telemetry.model.indexer.shape import MIB, IndexerShape

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "arm",
    [ArmSpec("stock"), ArmSpec("fixed"), ArmSpec("stock", "expandable_segments:True"),
     ArmSpec("fixed", "roundup_power2_divisions:4", True)],
    ids=lambda a: a.name,
)
def test_cuda_replay_matches_the_simulator_op_for_op(arm):
    params = ReplayParams(IndexerShape(layers=6, topk=2048), tokens=49_152,
                          pattern=LaunchPattern(transient_bytes=3 * MIB))
    real = replay(params, [arm], "cuda").arms[arm.name]
    sim = replay(params, [arm], "sim").arms[arm.name]
    assert real.trace.ops == sim.trace.ops
    assert real.trace.after == sim.trace.after


def test_cuda_reference_98k_stock_grows_fixed_is_flat():
    result = replay(ReplayParams(), [ArmSpec("stock"), ArmSpec("fixed")], "cuda")
    stock = result.arms["stock"].summary
    fixed = result.arms["fixed"].summary
    assert stock.steps_with_growth == list(range(8))  # every chunk until the budget is crossed
    assert fixed.steps_with_growth == [0]  # flat from the first chunk
    assert stock.reserved_growth_bytes > 4 * fixed.reserved_growth_bytes
