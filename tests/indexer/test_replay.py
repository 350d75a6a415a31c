"""`memtel replay` on the simulator, checked against the real allocator's replay records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from telemetry.cli import main
from telemetry.model.indexer.backends import SimBackend
from telemetry.model.indexer.prefill import LaunchPattern
from telemetry.model.indexer.replay import ArmSpec, ReplayParams, replay, summarize, trace_prefill
from telemetry.model.indexer.shape import IndexerShape

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "allocator-truth"
MIB = 1024 * 1024


def _real(mode: str) -> dict:
    return json.loads((FIXTURES / f"replay98k-h200-torch2.11-{mode}.json").read_text())


@pytest.mark.parametrize("mode", ["stock", "fixed"])
def test_sim_replay_is_the_real_allocators_replay_op_for_op(mode):
    result = replay(ReplayParams(), [ArmSpec(mode)], "sim")
    trace = result.arms[mode].trace
    real = _real(mode)["cases"][f"replay_{mode}"]
    assert trace.ops == real["ops"]  # the same op sequence as the H200 run
    assert trace.truth_rows() == real["after"]  # and the same counters after every op


def test_reference_shape_stock_grows_every_chunk_until_the_budget_fixed_is_flat():
    result = replay(ReplayParams(), [ArmSpec("stock"), ArmSpec("fixed")], "sim")
    stock = result.arms["stock"].summary
    fixed = result.arms["fixed"].summary
    real_stock = _real("stock")["cases"]["replay_stock"]["after"][-1]
    real_fixed = _real("fixed")["cases"]["replay_fixed"]["after"][-1]
    assert (stock.reserved_growth_bytes, stock.num_device_alloc) == (real_stock[0], real_stock[2])
    assert (fixed.reserved_growth_bytes, fixed.num_device_alloc) == (real_fixed[0], real_fixed[2])
    # Stock: every chunk step grows while one launch holds a chunk (kv length * 8192 * 4 <= 512 MiB).
    one_launch = [s for s in stock.chunk_steps if s.launches_per_layer == 1]
    assert one_launch and all(s.growth_bytes > 0 for s in one_launch)
    assert all(s.growth_bytes == 0 for s in stock.chunk_steps if s.launches_per_layer > 1)
    # Fixed: all growth in the first chunk step.
    assert fixed.steps_with_growth == [0]
    assert fixed.reserved_growth_bytes < stock.reserved_growth_bytes / 3


def test_new_segments_are_attributed_to_steps_and_layers():
    params = ReplayParams(IndexerShape(layers=3), tokens=32_768)
    arm = ArmSpec("stock")
    trace = trace_prefill(params, arm.mode, SimBackend())
    summary = summarize(params, arm, trace)
    assert sum(seg.num_device_alloc for seg in summary.new_segments) == summary.num_device_alloc
    assert {seg.step for seg in summary.new_segments} == set(summary.steps_with_growth)
    assert all(seg.layer in range(3) for seg in summary.new_segments)
    assert len(trace.step_end) == len(summary.chunk_steps) == len(params.plan("stock")) == 4


def test_private_mempool_isolates_logits_from_transients():
    shape = IndexerShape(layers=4)
    params = ReplayParams(shape, tokens=32_768, pattern=LaunchPattern(transient_bytes=3 * MIB))
    logits_only = replay(ReplayParams(shape, tokens=32_768), [ArmSpec("stock")], "sim").arms["stock"].summary
    result = replay(params, [ArmSpec("stock"), ArmSpec("stock", mempool=True)], "sim")
    private = result.arms["stock+mempool"].summary
    # In their own pool the logits reserve exactly what they reserve alone; the transients add
    # one 20 MiB segment of their own beside it.
    assert private.reserved_growth_bytes == logits_only.reserved_growth_bytes + 20 * MIB
    assert private.num_device_alloc == logits_only.num_device_alloc + 1
    assert result.arms["stock"].summary.mempool is False and private.mempool is True


def test_cli_table_json_plot_and_records(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["replay", "--allocator", "sim", "--tokens", "24576", "--layers", "2", "--out", str(out),
            "--record", str(tmp_path / "rec")]
    assert main([*argv, "--arm", "stock", "--arm", "fixed@expandable_segments:True"]) == 0
    text = capsys.readouterr().out
    assert "allocator: sim (--allocator sim)" in text
    assert "stock" in text and "fixed@expandable_segments:True" in text
    png = out / "replay-reserved.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "replay.json").read_text())
    assert set(summary["arms"]) == {"stock", "fixed@expandable_segments:True"}
    records = sorted((tmp_path / "rec").glob("*.json"))
    assert len(records) == 2
    assert main(["allocsim", "--check", str(records[1])]) == 0  # records replay on the simulator
    capsys.readouterr()
    assert main(["replay", "--allocator", "sim", "--tokens", "8192", "--layers", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["allocator"] == "sim" and set(data["arms"]) == {"stock", "fixed"}


def test_default_allocator_says_which_it_chose(capsys):
    assert main(["replay", "--tokens", "8192", "--layers", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["allocator"] in ("cuda", "sim")
    assert data["allocator_reason"].startswith("default")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--arm", "padded"], ["arm 'padded'", "stock, fixed"]),
        (["--arm", "stock+pool"], ["+pool", "+mempool"]),
        (["--arm", "stock@max_split_size_mb:2"], ["max_split_size_mb", ">= 20"]),
        (["--arm", "stock", "--arm", "stock"], ["arm 'stock' given twice"]),
    ],
)
def test_bad_arms_are_one_line_errors(argv, words, capsys):
    assert main(["replay", "--allocator", "sim", "--tokens", "8192", "--layers", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memtel replay: error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err


@pytest.mark.parametrize("argv, words", [
    (["--tokens", "0"], "argument --tokens: expected a positive integer, got 0"),
    (["--chunk", "0"], "argument --chunk: expected a positive integer, got 0"),
    (["--budget-mb", "0.000001"], "must hold at least one float32"),
    (["--transient-mb", "-1"], "argument --transient-mb: expected a number >= 0"),
])
def test_bad_numbers_are_refused_by_the_parser(argv, words, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["replay", "--allocator", "sim", *argv])
    assert exited.value.code == 2 and words in capsys.readouterr().err


def test_a_fractional_budget_is_used_to_the_byte(capsys):
    assert main(["replay", "--allocator", "sim", "--json", "--tokens", "16384", "--layers", "1", "--chunk", "4096",
                 "--budget-mb", "0.5"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["params"]["shape"]["logits_budget_bytes"] == MIB // 2
    # 4,096 rows of kv 1,024 floats is 16 MiB: split into launches of 128 rows (0.5 MiB each).
    assert data["arms"]["stock"]["chunk_steps"][0]["launches_per_layer"] == 32
