"""`memtel run` with real multi-process Python programs: every Python process it reaches gets the hook.

Spawned multiprocessing workers, a `subprocess.run([sys.executable, ...])` child, a torch.multiprocessing
pool and the lab indexer on the allocator simulator: each process that makes a hooked call gets its own
rank (its order in the run: nothing else names one here), its own exporter port (MEMTEL_PORT + rank) and
its own call log; the parent, which makes no hooked call, gets none of them.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.run.conftest import (
    PROGRAMS,
    announcements,
    listeners,
    logs_by_pid,
    memtel_run,
    memtel_run_command,
    scrape,
)
from tests.support.ports import free_port_block

TARGET = "memtel_run_target:logits"


@pytest.mark.slow
def test_spawned_and_subprocess_children_each_get_their_own_rank_port_and_log(tmp_path, run_env, handshake):
    base = free_port_block(8)
    log_dir = tmp_path / "logs"
    process = subprocess.Popen(
        [*memtel_run_command("--targets", TARGET, "--port", str(base), "--log-dir", str(log_dir)), "--",
         "python", str(PROGRAMS / "spawn_children.py"), str(handshake.directory)],
        env=run_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        workers = handshake.wait_ready(3, process)
        ports = {w["pid"]: w["port"] for w in workers}
        ranks = sorted(w["rank"] for w in workers)
        assert ranks == [0, 1, 2] and {w["source"] for w in workers} == {"run order"}
        assert sorted(ports.values()) == [base, base + 1, base + 2]
        live = listeners(range(base, base + 8))
        assert live == {port: pid for pid, port in ports.items()}   # the parent (memtel run's pid) listens nowhere
        assert process.pid not in live.values()
        for worker in workers:
            samples = scrape(worker["port"])
            (calls,) = [v for k, v in samples.items() if k.startswith("memtel_hook_calls_total{")]
            assert calls == worker["calls"]
            assert f'rank="{worker["rank"]}"' in next(k for k in samples if k.startswith("memtel_hook_calls_total{"))
    finally:
        handshake.go()
        stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    assert "children exit codes [0, 0, 0]" in stdout
    logs = logs_by_pid(log_dir)
    assert set(logs) == set(ports)   # no log for the parent
    for worker in workers:
        path, records = logs[worker["pid"]]
        assert path.name == f"memtel-calls-rank{worker['rank']}-pid{worker['pid']}.jsonl"
        assert [r["call"] for r in records] == list(range(worker["calls"]))
        assert {(r["site"], r["rank"], r["pid"]) for r in records} == {(TARGET, worker["rank"], worker["pid"])}
    said = announcements(stderr)
    assert set(said) == set(ports)
    for worker in workers:
        assert (f"rank {worker['rank']} (local rank {worker['rank']}, from run order); hooked: {TARGET}; "
                f"unresolved: none; exporter: http://127.0.0.1:{worker['port']}/metrics") in said[worker["pid"]]


@pytest.mark.slow
def test_a_torch_multiprocessing_pool_records_every_task_in_its_worker(tmp_path, run_env):
    log_dir = tmp_path / "logs"
    tasks = 6
    done = memtel_run(["--targets", "memtel_run_target:scale", "--port", "off", "--log-dir", str(log_dir)],
                      ["python", str(PROGRAMS / "torch_pool.py"), str(tasks)], {**run_env, "MEMTEL_RECORD_SHAPE": "1"})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [2.0 * 3 * (i + 1) for i in range(tasks)]
    logs = logs_by_pid(log_dir)
    assert len(logs) == 2, done.stderr   # the pool's two workers; the parent made no call
    records = [r for _, (_, rs) in sorted(logs.items()) for r in rs]
    assert sorted(r["shape"][0] for r in records) == [0, 0, *range(1, tasks + 1)]
    assert [rs[0]["shape"][0] for _, rs in logs.values()] == [0, 0]   # each worker's start call
    assert {r["shape"][1] for r in records} == {3}
    assert sorted({r["rank"] for r in records}) == [0, 1]
    for pid, (_, rs) in logs.items():
        assert {r["pid"] for r in rs} == {pid} and len({r["rank"] for r in rs}) == 1
        assert [r["call"] for r in rs] == list(range(len(rs)))
    assert set(announcements(done.stderr)) == set(logs)
    assert "exporter: off (no port: MEMTEL_PORT=off)" in next(iter(announcements(done.stderr).values()))


def test_the_lab_indexer_preset_on_the_simulator_in_spawned_workers(tmp_path, run_env):
    # The preset's target in workers that read the simulator's counters: each record is the simulator's state
    # right after its launch, and the growing widths show up as growth events.
    log_dir = tmp_path / "logs"
    out = tmp_path / "expected"
    out.mkdir()
    base = free_port_block(4)
    done = memtel_run(["--targets", "lab-indexer", "--port", str(base), "--log-dir", str(log_dir)],
                      ["python", str(PROGRAMS / "lab_simulator.py"), str(out)], run_env)
    assert done.returncode == 0, done.stderr
    logs = logs_by_pid(log_dir)
    assert len(logs) == 2
    for pid, (_, records) in logs.items():
        expected = json.loads((out / f"expected-{pid}.json").read_text())
        assert len(records) == len(expected) == 5
        for record, stats in zip(records, expected, strict=True):
            assert record["site"] == "telemetry.model.indexer.launch:indexer_logits_launch"
            assert record["device"] == "sim"
            assert {k: record[k] for k in stats} == stats
        reserved = [r["reserved_bytes"] for r in records]
        assert reserved == sorted(reserved) and reserved[-1] > reserved[0]   # growing widths: new segments


def test_two_processes_on_one_port_the_second_exports_nothing_and_both_run_and_log(tmp_path, run_env, handshake):
    # LOCAL_RANK=0 in both workers (a mistake, or two engines on one node): the second exporter cannot
    # listen. The program must run as if memtel were not there; the log is still written.
    base = free_port_block(4)
    log_dir = tmp_path / "logs"
    env = {**run_env, "LOCAL_RANK": "0"}
    process = subprocess.Popen(
        [*memtel_run_command("--targets", TARGET, "--port", str(base), "--log-dir", str(log_dir)), "--",
         "python", str(PROGRAMS / "spawn_children.py"), str(handshake.directory)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        workers = handshake.wait_ready(3, process)
        assert sorted((w["rank"], w["source"]) for w in workers) == [(0, "env")] * 3
        ports = [w["port"] for w in workers]
        assert sorted(ports, key=lambda p: p is None) == [base, None, None]
        (listening,) = [w["pid"] for w in workers if w["port"] == base]
        assert listeners(range(base, base + 4)) == {base: listening}
    finally:
        handshake.go()
        _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    assert stderr.count("memtel: hook exporter not started on 127.0.0.1 port") == 2
    assert len(logs_by_pid(log_dir)) == 3
    assert "Traceback" not in stderr

