"""`memtel replay` on the simulator, checked against the real allocator's replay records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.indexer.planner import plan_prefill
from harness.indexer.replay import ArmSpec, ReplayParams, replay, run_arm, summarize
from telemetry.cli import main

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "allocator-truth"
MIB = 1024 * 1024


def _real(mode: str) -> dict:
    return json.loads((FIXTURES / f"replay98k-h200-torch2.11-{mode}.json").read_text())


@pytest.mark.parametrize("mode", ["stock", "fixed"])
def test_sim_replay_is_the_real_allocators_replay_op_for_op(mode):
    result = replay(ReplayParams(), [ArmSpec(mode)], "sim")
    trace = result["arms"][mode]["trace"]
    real = _real(mode)["cases"][f"replay_{mode}"]
    assert trace["ops"] == real["ops"]  # the same op sequence as the H200 run
    assert trace["after"] == real["after"]  # and the same counters after every op


def test_reference_shape_stock_grows_every_chunk_until_the_budget_fixed_is_flat():
    result = replay(ReplayParams(), [ArmSpec("stock"), ArmSpec("fixed")], "sim")
    stock = result["arms"]["stock"]["summary"]
    fixed = result["arms"]["fixed"]["summary"]
    real_stock = _real("stock")["cases"]["replay_stock"]["after"][-1]
    real_fixed = _real("fixed")["cases"]["replay_fixed"]["after"][-1]
    assert (stock["reserved_growth_bytes"], stock["device_allocs"]) == (real_stock[0], real_stock[2])
    assert (fixed["reserved_growth_bytes"], fixed["device_allocs"]) == (real_fixed[0], real_fixed[2])
    # Stock: every chunk step grows while one launch holds a chunk (kv length * 8192 * 4 <= 512 MiB).
    one_launch = [s for s in stock["chunk_steps"] if s["launches_per_layer"] == 1]
    assert one_launch and all(s["growth_bytes"] > 0 for s in one_launch)
    assert all(s["growth_bytes"] == 0 for s in stock["chunk_steps"] if s["launches_per_layer"] > 1)
    # Fixed: all growth in the first chunk step.
    assert fixed["steps_with_growth"] == [0]
    assert fixed["reserved_growth_bytes"] < stock["reserved_growth_bytes"] / 3


def test_new_segments_are_attributed_to_steps_and_layers():
    params = ReplayParams(tokens=32_768, layers=3)
    arm = ArmSpec("stock")
    from harness.indexer.replay import SimBackend

    trace, steps = run_arm(params, arm, SimBackend(arm, None))
    summary = summarize(params, arm, trace, steps)
    assert sum(seg["device_allocs"] for seg in summary["new_segments"]) == summary["device_allocs"]
    assert {seg["step"] for seg in summary["new_segments"]} == set(summary["steps_with_growth"])
    assert all(seg["layer"] in range(3) for seg in summary["new_segments"])
    assert len(steps) == len(plan_prefill(32_768, params.planner("stock")))


def test_private_mempool_isolates_logits_from_transients():
    params = ReplayParams(tokens=32_768, layers=4, transient_mb=3.0)
    logits_only = replay(ReplayParams(tokens=32_768, layers=4), [ArmSpec("stock")], "sim")["arms"]["stock"]["summary"]
    result = replay(params, [ArmSpec("stock"), ArmSpec("stock", mempool=True)], "sim")
    private = result["arms"]["stock+mempool"]["summary"]
    # In their own pool the logits reserve exactly what they reserve alone; the transients add
    # one 20 MiB segment of their own beside it.
    assert private["reserved_growth_bytes"] == logits_only["reserved_growth_bytes"] + 20 * MIB
    assert private["device_allocs"] == logits_only["device_allocs"] + 1
    assert result["arms"]["stock"]["summary"]["mempool"] is False and private["mempool"] is True


def test_cli_table_json_plot_and_records(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["replay", "--allocator", "sim", "--tokens", "24576", "--layers", "2", "--out", str(out), "--record", str(tmp_path / "rec")]
    assert main(argv + ["--arm", "stock", "--arm", "fixed@expandable_segments:True"]) == 0
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
        (["--tokens", "0"], ["--tokens"]),
        (["--chunk", "0"], ["chunk"]),
    ],
)
def test_bad_options_are_clear_errors(argv, words, capsys):
    assert main(["replay", "--allocator", "sim"] + argv) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err
