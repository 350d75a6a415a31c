"""The native snapshot reader on a real CUDA allocator (marker gpu: run on the device machine).

tests/hook/snapshot_native_process.py, with the default settings and with expandable segments: the extension is
built in the background (or found in the cache) and loaded; on a messy state (split and whole segments, small
and large pools, a block pending free on another stream, a private pool's segment) the bytes it takes decode to
exactly `torch.cuda.memory_snapshot()`'s segments (the keys the simulator reads) and to the same
`read_allocator_state`; the hook's live forecast then takes its snapshots with it and forecasts what
`forecast()` on torch's snapshot does. The decoder's own checks run on the CPU (test_forecast_snapshot_native.py).
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


@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"])
def test_the_native_snapshot_decodes_to_torchs_on_a_messy_state(alloc_conf):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    done = subprocess.run([sys.executable, "-m", "tests.hook.snapshot_native_process"], capture_output=True,
                          text=True, cwd=ROOT, timeout=900, env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": alloc_conf,
                                                                 "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(out))
    assert out["native"] == "native"
    assert out["decoded_equals_torch"] and out["state_equals_torch"], out
    state = out["state"]
    assert isinstance(state, dict), state            # a state the simulator reads: the comparison means something
    assert state["pending_free_bytes"] >= 9 << 20, state
    assert state["blocks"] > state["segments"] >= (2 if alloc_conf else 10), state   # split segments
    assert state["private"] >= (1 if hasattr(torch.cuda, "MemPool") else 0), state
    assert (state["expandable"] > 0) == bool(alloc_conf), state
    hook = out["hook"]
    assert hook["reader"] == "native" and hook["equal"] and not hook["failures"], hook
    assert hook["helper_cpu_seconds"] > 0, hook
