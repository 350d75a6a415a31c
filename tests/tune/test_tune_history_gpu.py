"""`memtel tune` after a restart on a real GPU (marker gpu: run on the device machine): a messy history run for real
under each setting, each setting's real edge (to the token) equal to the prediction from the defaults' snapshot
plus that history (benchmarks/tune_history_gpu.py). Passed on the H200 (BENCHMARKS.md);
the capture it makes is replayed on every run by tests/tune/test_tune_history.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
@pytest.mark.parametrize("settings", ["base,expandable", "split256,gc06"])
def test_each_settings_real_edge_is_the_replayed_prediction(tmp_path: Path, settings: str) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    done = subprocess.run([sys.executable, "benchmarks/tune_history_gpu.py", "--out", str(tmp_path), "--settings",
                           settings, "--deadline-s", "420"], cwd=ROOT, capture_output=True, text=True, timeout=560,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads((tmp_path / "tune-history.json").read_text())
    for name, row in doc["settings"].items():
        assert row["exact"], (name, row)
        assert row["longest_fit"] == row["predicted"], (name, row)


def test_the_script_runs_end_to_end_on_the_simulator(tmp_path: Path) -> None:
    """The same script with the lab's simulator standing for CUDA (its agreement is by construction): the script
    itself works before a GPU session spends time on it."""
    done = subprocess.run([sys.executable, "benchmarks/tune_history_gpu.py", "--out", str(tmp_path), "--settings",
                           "expandable", "--deadline-s", "120", "--dry-run-sim"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads((tmp_path / "tune-history.json").read_text())["settings"]["expandable"]
    assert row["exact"] and row["longest_fit"] == row["predicted"]
