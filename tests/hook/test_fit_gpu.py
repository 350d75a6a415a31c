"""The longest prefill that fits, on a real GPU under a memory cap (marker gpu: run on the device machine).

tests/hook/fit_process.py under `per_process_memory_fraction` (about 1.1 GiB of the device), and on a device
shared with another process that holds all but 1.6 GiB (issue 32: the driver's own limit), with the defaults
and with expandable segments: the gauge is read, a prefill of exactly that many tokens runs without running
out of memory, and a prefill a chunk longer than the gauge read again afterwards is forecast not to fit and
really runs out of memory. Figures: BENCHMARKS.md, "Longest prefill that fits" and "The gauge at the edge of a
shared device". And tests/hook/at_best_process.py: the at-best gauge, with a cache of freed allocations, fits once
torch.cuda.empty_cache() released it.
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
CAP_BYTES = int(1.1 * (1 << 30))


def run_capped(module: str, alloc_conf: str, cap_bytes: int) -> dict:
    """`python -m module` on device 0 under `per_process_memory_fraction` of `cap_bytes` (beside `alloc_conf`):
    the JSON object its last line prints (skipped without a CUDA device)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    total = torch.cuda.mem_get_info(0)[1]
    conf = ",".join(p for p in (alloc_conf, f"per_process_memory_fraction:{round(cap_bytes / total, 6)}") if p)
    done = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-4000:]
    out: dict = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(out))
    return out


@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"])
def test_the_gauge_fits_and_a_chunk_more_runs_out_of_memory(alloc_conf):
    out = run_capped("tests.hook.fit_process", alloc_conf, CAP_BYTES)
    first, second = out["first"], out["second"]
    assert 8192 < first["gauge"] < 204_800, first   # the cap cuts the range: the check means something
    assert not first["forecast"]["out_of_memory"] and not first["out_of_memory"], first
    assert first["peak_reserved"] == first["forecast"]["peak_reserved"], first
    assert second["forecast"]["out_of_memory"], second      # the forecast says a chunk more does not fit
    assert second["out_of_memory"], second                  # and it does not


@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"])
def test_on_a_shared_device_the_gauge_fits_and_a_chunk_more_runs_out_of_memory(alloc_conf):
    """Issue 32: another process holds all but 1.6 GiB of the device; no memory fraction, MEMTEL_GUARD_RESERVE_MB=0,
    so the gauge is the raw edge under the driver's own limit (less the driver's slack, telemetry/fit_budget.py)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    holder = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "fit_edge_gpu.py"), "--hold", "--free-gib",
                               "1.6"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout is not None
        held = json.loads(holder.stdout.readline())
        done = subprocess.run([sys.executable, "-m", "tests.hook.fit_process"], capture_output=True, text=True,
                              cwd=ROOT, timeout=300, env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": alloc_conf,
                                                          "MEMTEL_GUARD_RESERVE_MB": "0", "PYTHONPATH": str(ROOT)})
    finally:
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.close()
        holder.wait(timeout=30)
        holder.stdout.close()
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps({"held": held, **out}))
    first, second = out["first"], out["second"]
    assert 8192 < first["gauge"] < 204_800, first   # the device's free memory cuts the range
    assert not first["out_of_memory"], first             # exactly the gauge fits
    assert second["out_of_memory"], second               # a chunk more does not


@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"])
def test_the_at_best_gauge_fits_once_the_cache_is_emptied(alloc_conf):
    """memtel_forecast_max_prefill_tokens_at_best (tests/hook/at_best_process.py): after growing allocations are
    freed (cached), at-best is at least the limit now, and a prefill of exactly at-best runs without running out of
    memory after torch.cuda.empty_cache(), under the same cap."""
    # Expandable segments map only what is used: the whole 204,800 tokens peak at 1,155,530,752 bytes reserved
    # under this workload on the H200 (2026-12-03), within 1.1 GiB, so a 1.0 GiB cap is what cuts the range there.
    out = run_capped("tests.hook.at_best_process", alloc_conf, (1 << 30) if alloc_conf else CAP_BYTES)
    assert out["held_free_bytes"] > 0, out                    # the allocator held a cache to release
    assert 8192 < out["at_best"] < 204_800, out               # the cap cuts the range: the check means something
    assert out["at_best"] >= out["gauge"], out
    assert not out["at_best_prefill"]["out_of_memory"], out   # exactly at-best fits with the cache emptied
