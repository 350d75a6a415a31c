"""Rank resolution at the first record: torch.distributed, else vLLM's state, else RANK/LOCAL_RANK, else 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from telemetry.hook.rank import RankInfo, resolve_rank

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("environ, expected", [
    ({}, RankInfo(0, 0, "default")),
    ({"RANK": "5", "LOCAL_RANK": "1"}, RankInfo(5, 1, "env")),
    ({"LOCAL_RANK": "3"}, RankInfo(3, 3, "env")),
    ({"RANK": "4"}, RankInfo(4, 4, "env")),
    ({"RANK": "x", "LOCAL_RANK": "-2"}, RankInfo(0, 0, "default")),
])
def test_environment_fallbacks(environ, expected):
    assert resolve_rank(environ) == expected


def test_initialized_torch_distributed_wins_over_the_environment(tmp_path):
    pytest.importorskip("torch")
    code = (
        "import json, sys\n"
        "import torch.distributed as dist\n"
        "from telemetry.hook.rank import resolve_rank\n"
        "env = {'RANK': '7', 'LOCAL_RANK': '2'}\n"
        "before = resolve_rank(env)\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1)\n"
        "after = resolve_rank(env)\n"
        "dist.destroy_process_group()\n"
        "print(json.dumps([before.__dict__, after.__dict__]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    before, after = json.loads(out.stdout.splitlines()[-1])
    assert before == {"rank": 7, "local_rank": 2, "source": "env"}
    # One node, no vLLM: LOCAL_RANK still names the port offset, the rank comes from the group.
    assert after == {"rank": 0, "local_rank": 2, "source": "torch.distributed"}
