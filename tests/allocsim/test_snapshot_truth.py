"""The seeded simulator, `forecast` and `whatif` against real allocator truth from live H200 processes.

Fixtures: tests/fixtures/allocator-snapshots/<platform>/, one folder per capture made by
telemetry/model/capture/snapshots.py (h200-torch2.11: torch 2.11 on an H200; see its README); a new
folder adds its cases to every test here. Seeded captures: a process built
allocator state, saved its snapshot (JSON and pickle), then ran the next prefill with the counters
after every op. What-if captures: one real-op workload recorded with `_record_memory_history` under
the defaults, and run without recording under other settings, counters at the same checkpoints.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from telemetry.model.allocsim.ops import first_mismatch, replay_ops
from telemetry.model.allocsim.simulator import DEFAULT_TOTAL_MEMORY
from telemetry.model.allocsim.snapshot import load_allocator_state
from telemetry.model.allocsim.trace import load_trace
from telemetry.model.allocsim.whatif import whatif
from telemetry.model.capture.snapshots import RING_ENTRIES
from telemetry.model.indexer.forecast import forecast
from telemetry.model.indexer.shape import IndexerShape
from tests.support.cli import call_main

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / "tests" / "fixtures" / "allocator-snapshots"
# MEMTEL_SNAPSHOT_FIXTURES: check a fresh capture folder instead (e.g. one just made on the GPU machine).
CAPTURES = ([Path(os.environ["MEMTEL_SNAPSHOT_FIXTURES"])] if os.environ.get("MEMTEL_SNAPSHOT_FIXTURES")
            else sorted(p for p in ROOT.iterdir() if p.is_dir()))
SEEDED = [p for folder in CAPTURES for p in sorted(folder.glob("seeded-*.json"))]
SEEDED_IDS = [f"{p.parent.name}/{p.stem}" for p in SEEDED]
SNAPSHOT_KINDS = ("json", "pickle")


def _doc(path: Path) -> dict:
    return json.loads(path.read_text())


def test_the_fixtures_are_there():
    assert CAPTURES and len(SEEDED) >= 6, f"seeded captures missing in {CAPTURES}"
    configs = {_doc(p)["config"] for p in SEEDED}
    assert {"", "expandable_segments:True"} <= configs
    assert {_doc(p)["mode"] for p in SEEDED} == {"stock", "fixed"}


@pytest.mark.parametrize("kind", SNAPSHOT_KINDS)
@pytest.mark.parametrize("path", SEEDED, ids=SEEDED_IDS)
def test_snapshot_holds_the_counters_the_process_had(path: Path, kind: str):
    doc = _doc(path)
    state = load_allocator_state(path.parent / doc["snapshot"][kind])
    reserved, allocated = doc["state_base"][:2]
    assert (state.counters.reserved_bytes, state.counters.allocated_bytes) == (reserved, allocated)
    if kind == "pickle":
        assert state.alloc_conf == doc["config"]  # the recorded allocator settings


@pytest.mark.parametrize("kind", SNAPSHOT_KINDS)
@pytest.mark.parametrize("path", SEEDED, ids=SEEDED_IDS)
def test_allocsim_from_snapshot_reproduces_every_row(path: Path, kind: str):
    doc = _doc(path)
    state = load_allocator_state(path.parent / doc["snapshot"][kind])
    case = doc["cases"]["next_prefill"]
    rows = replay_ops(case["ops"], doc["config"], start=state)
    mismatch = first_mismatch(case["after"], rows)
    if mismatch is not None:
        index, want, have = mismatch
        pytest.fail(f"{path.name} [{kind}]: op {index} {case['ops'][index]}: real {want}, seeded simulator {have}")


@pytest.mark.parametrize("path", SEEDED, ids=SEEDED_IDS)
def test_forecast_gives_the_growth_the_process_had(path: Path):
    doc = _doc(path)
    state = load_allocator_state(path.parent / doc["snapshot"]["json"])
    spec = doc["next_prefill"]
    shape = IndexerShape(layers=spec["layers"], chunk=spec["chunk"], max_model_len=spec["max_model_len"])
    result = forecast(state, shape, spec["tokens"], mode=spec["mode"], alloc_conf=doc["config"])
    after = doc["cases"]["next_prefill"]["after"]
    assert result.reserved_growth_bytes == after[-1][0]
    assert result.peak_growth_bytes == max(row[0] for row in after)
    assert result.peak_reserved_bytes == doc["state_base"][0] + max(row[0] for row in after)
    assert result.num_device_alloc == after[-1][2]
    assert result.num_device_free == after[-1][3]
    # The growth steps add up to the growth.
    assert sum(step.growth_bytes for step in result.growth_steps) == result.reserved_growth_bytes


def test_allocsim_command_checks_a_seeded_capture():
    path = next(p for p in SEEDED if _doc(p)["config"] == "")
    doc = _doc(path)
    done = call_main(["allocsim", "--check", str(path), "--from-snapshot",
                      str(path.parent / doc["snapshot"]["pickle"])], cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all rows agree" in done.stdout


@pytest.mark.parametrize("mode", ["stock", "fixed"])
def test_forecast_command_gives_the_growth_the_process_had(mode):
    path = next(p for p in SEEDED if _doc(p)["config"] == "" and _doc(p)["mode"] == mode
                and _doc(p)["cases"]["next_prefill"]["after"][-1][0] > 0)
    doc = _doc(path)
    spec = doc["next_prefill"]
    done = call_main(["forecast", "--snapshot", str(path.parent / doc["snapshot"]["pickle"]), "--tokens",
                      f"1000,{spec['tokens']}", "--layers", str(spec["layers"]), "--chunk", str(spec["chunk"]),
                      "--mode", mode, "--json"], cwd=REPO)
    assert done.returncode == 0, done.stderr
    small, full = json.loads(done.stdout)["forecasts"]
    after = doc["cases"]["next_prefill"]["after"]
    assert (full["reserved_growth_bytes"], full["num_device_alloc"]) == (after[-1][0], after[-1][2])
    assert full["alloc_conf"] == ""  # the settings the pickle recorded
    assert small["tokens"] == 1000 and small["reserved_growth_bytes"] <= full["reserved_growth_bytes"]
    table = call_main(["forecast", "--snapshot", str(path.parent / doc["snapshot"]["json"]), "--tokens",
                       str(spec["tokens"]), "--layers", str(spec["layers"]), "--mode", mode], cwd=REPO)
    assert table.returncode == 0 and f"{after[-1][0] / 2**20:+,.0f} MiB" in table.stdout


# ---- what-if ---------------------------------------------------------------------------------

WHATIF = [folder for folder in CAPTURES if (folder / "whatif-recorded.pickle.gz").exists()]
SETTINGS = [p for folder in WHATIF for p in sorted(folder.glob("whatif-setting-*.json"))]
SETTING_IDS = [f"{p.parent.name}/{p.stem}" for p in SETTINGS]


def _checkpoints(doc: dict) -> list[list[int]]:
    """A capture's counters at the workload's checkpoints (its last row is the end, where the dump was made:
    `_dump_snapshot()` copies the history before it logs its own `snapshot` event)."""
    return doc["checkpoints"][:-1]


def _end(doc: dict) -> list[int]:
    return doc["checkpoints"][-1]


def _setting_key(doc: dict) -> str:
    if doc.get("fraction") is not None:
        return f"{doc['config']},per_process_memory_fraction:{doc['fraction']}"
    return doc["config"]


_WHATIF: dict[Path, object] = {}


def _recorded_whatif(folder: Path):
    if folder not in _WHATIF:
        configs = [_setting_key(_doc(p)) for p in sorted(folder.glob("whatif-setting-*.json"))]
        _WHATIF[folder] = whatif(load_trace(folder / "whatif-recorded.pickle.gz"), configs)
    return _WHATIF[folder]


def test_whatif_fixtures_cover_the_settings_the_issue_names():
    assert WHATIF, f"no recorded history in {CAPTURES}"
    for folder in WHATIF:
        docs = [_doc(p) for p in folder.glob("whatif-setting-*.json")]
        keys = {_setting_key(d) for d in docs}
        assert "" in keys and "expandable_segments:True" in keys
        assert any(k.startswith("max_split_size_mb") for k in keys)
        assert any(k.startswith("roundup_power2_divisions") for k in keys)
        assert any("garbage_collection_threshold" in k and "per_process_memory_fraction" in k for k in keys)
        assert all(d["total_memory"] == DEFAULT_TOTAL_MEMORY for d in docs)  # what the fraction is of


@pytest.mark.parametrize("folder", WHATIF, ids=[f.name for f in WHATIF])
def test_recording_does_not_change_the_counters(folder: Path):
    recorded = _doc(folder / "whatif-recorded.json")["checkpoints"]
    plain = _doc(folder / "whatif-setting-default.json")["checkpoints"]
    assert recorded == plain
    assert len(recorded) >= 5 and recorded[-1][2] > 0


@pytest.mark.parametrize("folder", WHATIF, ids=[f.name for f in WHATIF])
def test_whatif_reproduces_the_recorded_device_calls_exactly(folder: Path):
    result = _recorded_whatif(folder)
    assert result.reproduces_segment_events, result.segment_difference
    assert not result.incomplete, result.incomplete
    assert len(result.plan.expected) > 10
    assert result.plan.empty_caches >= 1  # the workload's empty_cache() calls, inferred
    recorded = _doc(folder / "whatif-recorded.json")
    assert result.plan.checkpoints == len(_checkpoints(recorded)) == len(recorded["trace_positions"])
    assert result.replays[""].checkpoints == _checkpoints(recorded)
    assert result.replays[""].final == _end(recorded)


@pytest.mark.parametrize("path", SETTINGS, ids=SETTING_IDS)
def test_whatif_reproduces_every_checkpoint_of_every_setting(path: Path):
    doc = _doc(path)
    replay = _recorded_whatif(path.parent).replays[_setting_key(doc)]
    mismatch = first_mismatch(_checkpoints(doc), replay.checkpoints)
    assert mismatch is None, f"{path.name}: checkpoint {mismatch[0]}: real {mismatch[1]}, whatif {mismatch[2]}"
    assert replay.final == _end(doc)
    assert replay.peak_reserved == doc["peak_reserved"]


@pytest.mark.parametrize("folder", WHATIF, ids=[f.name for f in WHATIF])
def test_a_history_whose_ring_dropped_its_start_is_reported_incomplete(folder: Path):
    result = whatif(load_trace(folder / "whatif-ring.pickle.gz"), [])
    assert len(result.trace.events) == RING_ENTRIES  # the ring was full: its start is gone
    assert result.incomplete
    assert any("never allocated" in reason for reason in result.incomplete)
    assert not result.reproduces_segment_events


def test_whatif_command_json_has_the_issue_shape():
    folder = WHATIF[0]
    done = call_main(["whatif", str(folder / "whatif-recorded.pickle.gz"), "--config", "expandable_segments:True",
                      "--json"], cwd=REPO)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert set(doc["configs"]) == {"", "expandable_segments:True"}
    for entry in doc["configs"].values():
        assert {"checkpoints", "peak_reserved", "num_device_alloc"} <= set(entry)
        assert all(len(row) == 4 for row in entry["checkpoints"])
    assert doc["trace"]["reproduces_segment_events"] is True and doc["trace"]["complete"] is True
