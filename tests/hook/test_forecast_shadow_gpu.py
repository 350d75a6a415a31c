"""The event shadow on a real CUDA allocator (marker gpu: run on the device machine).

tests/hook/shadow_process.py, with the default settings and with expandable segments: phase by phase (allocations
and frees of many sizes, steps of temporaries freed innermost first (pairs the extension leaves out of its
log), empty_cache, a free pending on another stream and its completion, allocations on another
stream, a private pool), the shadow replayed from the allocator's events must equal
`read_allocator_state(torch.cuda.memory_snapshot())` (and torch's segments, key by key), or have given up with a
named reason and started again from a full snapshot: never a wrong state. The phases it models (the default
stream's allocations and frees, empty_cache, pending frees) must be followed without a resync under the default
settings. Then the hook's forecast thread on the shadow: a cycle after allocations forecasts what `forecast()` on
torch's snapshot does, without a resync after the first snapshot. The replay's own checks run on the CPU
(test_forecast_shadow.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
MODELLED = {"mix", "steps", "empty_cache", "pending", "completed"}


@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"])
def test_the_event_shadow_equals_torchs_snapshot_or_resyncs(alloc_conf):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    done = subprocess.run([sys.executable, "-m", "tests.hook.shadow_process"], capture_output=True, text=True,
                          cwd=ROOT, timeout=900, env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": alloc_conf,
                                                      "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(out))
    results = [result for _, result in out["phases"]]
    assert not [r for r in results if r.startswith("WRONG") or r.startswith("seed failed")], out["phases"]
    assert out["events"] > 1000, out
    assert out["coalesced"] > 300, out   # the steps' pairs were left out of the log, and the states stayed equal
    equal = [name for name, result in out["phases"] if result == "equal"]
    assert len(equal) >= 5, out["phases"]     # the comparison is made on followed states, not only fresh seeds
    if not alloc_conf:
        followed = [result for name, result in out["phases"] if name in MODELLED]
        assert all(r == "equal" for r in followed), out["phases"]
    hook = out["hook"]
    assert hook["reader"] == "native" and hook["ran"] and not hook["failures"], hook
    assert hook["first_resyncs"] == {"start": 1}, hook
    assert hook["changed"] and hook["equal"], hook
    if not alloc_conf:
        assert hook["resyncs"] == {"start": 1}, hook
