"""The one launch loop, as the replay, the demo's prediction and a lab server rank run it.

`memtel demo --budget-mb 96.5` once predicted 113 MB / 5 device allocations against its servers' 140 MB / 7
(the prediction truncated the budget to whole MiB), and `--budget-mb 0.5` crashed the prediction: the
budget now has one name and one unit, and the three users of the loop are checked against each other
at fractional budgets.
"""

from __future__ import annotations

import argparse

import pytest

from harness.ab.config import Step
from harness.demo.notes import predict
from harness.demo.setup import DemoSetup
from harness.labserver.cli import config_from_args, configure
from harness.labserver.worker import Rank
from telemetry.model.indexer.backends import SimBackend
from telemetry.model.indexer.planner import ChunkStep, Launch, plan_prefill
from telemetry.model.indexer.prefill import LaunchPattern, PrefillObserver, run_prefill
from telemetry.model.indexer.replay import ReplayParams, trace_prefill
from telemetry.model.indexer.shape import MIB, IndexerShape, budget_bytes_from_mib

STEPS = [Step("a", 8192, 1), Step("b", 8192, 2), Step("c", 16384, 3)]


class Events(PrefillObserver):
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def step_started(self, step: ChunkStep, launches: list[Launch]) -> None:
        self.events.append(("start", step.index, len(launches)))

    def launch_started(self, step: ChunkStep, layer: int, index: int) -> None:
        self.events.append(("launch", step.index, layer, index))

    def op_done(self, op: list[object]) -> None:
        self.events.append(tuple(op))

    def step_ended(self, step: ChunkStep, launches: list[Launch]) -> None:
        self.events.append(("end", step.index))


def test_the_loop_keeps_one_logits_alive_across_layers_and_frees_the_last_before_the_last_step_ends():
    shape = IndexerShape(layers=2, chunk=4, compress_ratio=1, max_model_len=64, topk=3)
    events = Events()
    done = run_prefill(SimBackend(), shape, "stock", 8, observer=events, pattern=LaunchPattern(transient_bytes=100))
    assert done.launches == 4 and done.chunk_steps == 2
    assert events.events == [
        ("start", 0, 1),
        ("launch", 0, 0, 0), ("malloc", 0, 4 * 4 * 4), ("malloc", 1, 4 * 3 * 4), ("malloc", 2, 4 * 3 * 8),
        ("malloc", 3, 100), ("free", 3), ("free", 2), ("free", 1),
        ("launch", 0, 1, 0), ("malloc", 4, 64), ("malloc", 5, 48), ("malloc", 6, 96), ("malloc", 7, 100),
        ("free", 7), ("free", 6), ("free", 5), ("free", 0),
        ("end", 0),
        ("start", 1, 1),
        ("launch", 1, 0, 0), ("malloc", 8, 4 * 8 * 4), ("malloc", 9, 48), ("malloc", 10, 96), ("malloc", 11, 100),
        ("free", 11), ("free", 10), ("free", 9), ("free", 4),
        ("launch", 1, 1, 0), ("malloc", 12, 128), ("malloc", 13, 48), ("malloc", 14, 96), ("malloc", 15, 100),
        ("free", 15), ("free", 14), ("free", 13), ("free", 8), ("free", 12),
        ("end", 1),
    ]


def test_scaled_launches_keep_at_least_one_row():
    assert LaunchPattern(row_scale=0.25).rows(10) == 3
    assert LaunchPattern(row_scale=0.001).rows(10) == 1
    assert LaunchPattern().rows(10) == 10


def _lab_rank(setup: DemoSetup, mode: str) -> Rank:
    """A lab server rank, in this process, configured by the lab server's own command line as the demo writes it."""
    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(["serve", "--arm", mode, "--no-unified-memory", "--no-hook", *setup.serve_args()])
    config = config_from_args(args)
    assert config.shape == setup.shape and config.scale == setup.scale  # the servers get exactly the demo's shape
    return Rank(config.rank_config(0))


@pytest.mark.parametrize("budget_mb", [64, 96.5, 0.5, 3.3])
@pytest.mark.parametrize("mode", ["stock", "fixed"])
def test_the_demo_prediction_and_a_lab_rank_agree_at_any_budget(budget_mb, mode):
    shape = IndexerShape(layers=3, chunk=4096, max_model_len=32_768,
                         logits_budget_bytes=budget_bytes_from_mib(budget_mb))
    setup = DemoSetup(allocator="sim", scale=0.3, time_scale=0.0, shape=shape)
    predicted = predict(setup, STEPS, mode)
    rank = _lab_rank(setup, mode)
    try:
        for step, prediction in zip(STEPS, predicted, strict=True):
            done = rank.prefill(0, step.tokens)
            counters = rank.backend.counters()
            assert (counters.reserved_bytes, counters.num_device_alloc) == (
                prediction.reserved_after_bytes, prediction.num_device_alloc_after), (budget_mb, mode, step)
            assert done.launches == sum(len(launches) for _, launches in plan_prefill(step.tokens, shape, mode)) * 3
    finally:
        rank.close()


def test_the_replay_trace_and_the_prediction_are_the_same_loop():
    shape = IndexerShape(layers=4, chunk=4096, max_model_len=65_536, logits_budget_bytes=24 * MIB + 1)
    trace = trace_prefill(ReplayParams(shape, tokens=20_000), "stock", SimBackend())
    prediction = predict(DemoSetup(allocator="sim", scale=1.0, time_scale=0, shape=shape), [Step("x", 20_000, 1)],
                         "stock")[0]
    assert trace.after[-1].reserved_bytes == prediction.reserved_after_bytes
    assert trace.after[-1].num_device_alloc == prediction.num_device_alloc_after
    assert [trace.after[i].reserved_bytes for i in trace.step_end] == [
        sum(prediction.chunk_step_growth_bytes[:n + 1]) for n in range(len(trace.step_end))]
