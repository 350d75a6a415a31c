"""Live on a CUDA GPU (marker `gpu`): a fresh capture agrees with the seeded simulator, `forecast` and `whatif`.

The same checks as test_snapshot_truth.py, on captures made now by telemetry/model/capture/snapshots.py
(one seeded process; the small what-if workload recorded, and run plain under two settings).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from telemetry.model.allocsim.ops import first_mismatch, replay_ops
from telemetry.model.allocsim.snapshot import load_allocator_state
from telemetry.model.allocsim.trace import load_trace
from telemetry.model.allocsim.whatif import whatif
from telemetry.model.indexer.forecast import forecast
from telemetry.model.indexer.shape import IndexerShape

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]


def _worker(out: Path, config: str, *args: str) -> None:
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=config, PYTHONPATH=str(REPO))
    env.pop("PYTORCH_ALLOC_CONF", None)
    done = subprocess.run([sys.executable, "-m", "telemetry.model.capture.snapshots", "--out", str(out), *args],
                          env=env, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("config", ["", "expandable_segments:True"])
def test_a_live_seeded_capture_agrees_with_allocsim_and_forecast(tmp_path, config):
    _worker(tmp_path, config, "--worker", "seeded", "--mode", "stock", "--state-tokens", "24576")
    (path,) = tmp_path.glob("seeded-*.json")
    doc = json.loads(path.read_text())
    case = doc["cases"]["next_prefill"]
    for kind in ("json", "pickle"):
        state = load_allocator_state(tmp_path / doc["snapshot"][kind])
        assert first_mismatch(case["after"], replay_ops(case["ops"], config, start=state)) is None
    spec = doc["next_prefill"]
    shape = IndexerShape(layers=spec["layers"], chunk=spec["chunk"], max_model_len=spec["max_model_len"])
    result = forecast(state, shape, spec["tokens"], mode="stock", alloc_conf=config)
    assert result.reserved_growth_bytes == case["after"][-1][0]
    assert result.num_device_alloc == case["after"][-1][2]


def test_a_live_recorded_history_replays_exactly(tmp_path):
    _worker(tmp_path, "", "--worker", "recorded", "--small")
    _worker(tmp_path, "", "--worker", "setting", "--small")
    _worker(tmp_path, "expandable_segments:True", "--worker", "setting", "--small")
    recorded = json.loads((tmp_path / "whatif-recorded.json").read_text())
    plain = json.loads((tmp_path / "whatif-setting-default.json").read_text())
    expandable = json.loads((tmp_path / "whatif-setting-expandable-segments-True.json").read_text())
    assert recorded["checkpoints"] == plain["checkpoints"]  # recording changes nothing
    result = whatif(load_trace(tmp_path / "whatif-recorded.pickle.gz"), ["expandable_segments:True"])
    assert result.reproduces_segment_events, result.segment_difference
    assert not result.incomplete, result.incomplete
    # A capture's last row is the end; `_dump_snapshot()` logs no `snapshot` event of its own in the history.
    assert result.replays[""].checkpoints == plain["checkpoints"][:-1]
    assert result.replays[""].final == plain["checkpoints"][-1]
    assert result.replays["expandable_segments:True"].checkpoints == expandable["checkpoints"][:-1]
    assert result.replays["expandable_segments:True"].final == expandable["checkpoints"][-1]
