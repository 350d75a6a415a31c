"""Ranks for real: a torch.distributed program of two ranks under `memtel run`, launched by torchrun.

On a machine with two GPUs (marker gpu; skipped unless torch sees >= 2): NCCL, one GPU per rank, NVLink
multicast off (NCCL_NVLS_ENABLE=0). Each rank's exporter (MEMTEL_PORT + its local rank) and call log carry
its own rank and device, and the allocator counters it exports equal that device's
`torch.cuda.memory_stats()` read in the rank right after its last hooked call. torchrun's launcher (the
run's first Python process) makes no hooked call and listens nowhere. Run it with
`python3 -m pytest -q tests/run/test_distributed_gpu.py -m gpu` from the repository root: memtel need not be
installed (the checkout is put on the children's PYTHONPATH).

The same program on the CPU with gloo (no marker: CI runs it) checks the launcher, the ranks, the ports and
the logs; the counters need CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.run.conftest import PROGRAMS, announcements, listeners, logs_by_pid, scrape
from tests.support.ports import free_port_block

ROOT = Path(__file__).resolve().parents[2]
TARGET = "memtel_run_target:device_logits"
# exported metric -> the counter in the rank's report (programs/distributed_ranks.py)
METRICS = {"memtel_allocator_reserved_bytes": "reserved_bytes", "memtel_allocator_allocated_bytes": "allocated_bytes",
           "memtel_allocator_device_alloc_total": "num_device_alloc",
           "memtel_allocator_device_free_total": "num_device_free",
           "memtel_allocator_alloc_retries_total": "num_alloc_retries", "memtel_allocator_ooms_total": "num_ooms"}


def two_gpus() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


def run_two_ranks(tmp_path: Path, run_env: dict[str, str], handshake, kind: str) -> None:
    base = free_port_block(4)
    log_dir = tmp_path / "logs"
    env = {**run_env, "PYTHONPATH": os.pathsep.join([str(PROGRAMS), str(ROOT)]), "NCCL_NVLS_ENABLE": "0",
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "telemetry", "run", "--targets", TARGET, "--port", str(base), "--log-dir",
               str(log_dir), "--", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "2", str(PROGRAMS / "distributed_ranks.py"), str(handshake.directory), kind]
    process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ranks = sorted(handshake.wait_ready(2, process, timeout=300), key=lambda r: r["dist_rank"])
        samples = {r["dist_rank"]: scrape(r["port"]) for r in ranks}
        live = listeners(range(base, base + 4))
    finally:
        handshake.go()
        _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-5000:]
    assert [(r["dist_rank"], r["rank"], r["source"], r["local_rank"], r["port"]) for r in ranks] == [
        (0, 0, "torch.distributed", 0, base), (1, 1, "torch.distributed", 1, base + 1)]
    assert live == {base: ranks[0]["pid"], base + 1: ranks[1]["pid"]}   # the launcher listens nowhere
    devices = [r["device"] for r in ranks]
    assert devices == (["cuda:0", "cuda:1"] if kind == "cuda" else ["cpu", "cpu"])
    logs = logs_by_pid(log_dir)
    assert set(logs) == {r["pid"] for r in ranks}
    said = announcements(stderr)
    for r in ranks:
        path, records = logs[r["pid"]]
        assert path.name == f"memtel-calls-rank{r['rank']}-pid{r['pid']}.jsonl"
        assert {(x["rank"], x["device"], x["site"]) for x in records} == {(r["rank"], r["device"], TARGET)}
        assert [x["call"] for x in records] == list(range(r["calls"]))
        assert f"rank {r['rank']} (local rank {r['rank']}, from torch.distributed)" in said[r["pid"]]
        exported = {name: [v for k, v in samples[r["dist_rank"]].items() if k.startswith(name + "{")]
                    for name in METRICS}
        labels = next(k for k in samples[r["dist_rank"]] if k.startswith("memtel_hook_calls_total{"))
        assert f'rank="{r["rank"]}"' in labels
        if kind == "cuda":
            # The exporter and the last record hold what the device's own memory_stats() said then.
            assert {name: values for name, values in exported.items()} == {
                name: [float(r["counters"][field])] for name, field in METRICS.items()}
            assert {field: records[-1][field] for field in METRICS.values()} == r["counters"]
            assert r["counters"]["reserved_bytes"] > 0
        else:
            assert all(values == [] for values in exported.values())   # no allocator on the CPU: absent, not 0
    if kind == "cuda":   # rank 1's launches are twice rank 0's: its device reserved more
        assert ranks[1]["counters"]["reserved_bytes"] > ranks[0]["counters"]["reserved_bytes"]


@pytest.mark.gpu
@pytest.mark.skipif(not two_gpus(), reason="needs 2 CUDA GPUs (the nvidia-h200-x2 device kind)")
def test_two_nccl_ranks_export_their_own_rank_device_and_counters(tmp_path, run_env, handshake):
    run_two_ranks(tmp_path, run_env, handshake, "cuda")


@pytest.mark.slow
def test_two_gloo_ranks_on_the_cpu_get_their_own_rank_port_and_log(tmp_path, run_env, handshake):
    run_two_ranks(tmp_path, run_env, handshake, "cpu")
