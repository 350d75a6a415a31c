"""Two lab nodes of different memory behind one `memtel guard` (--replica, --queue-s): long prompts go to the
big node, a burst waits instead of being refused, and nothing runs out of memory.

The nodes are harness/demo/guarded.py's (`memtel lab serve`, one rank, the hook's live forecast on): 1.5 GiB
takes about 401k tokens at rest, 0.8 GiB about 213k. Every process is a real one over loopback and is stopped.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from harness.demo.guarded import FORECAST_ENV, NODE_ARGS, Process, guard_limit, start_guard
from harness.processes import wait_healthy
from tests.guard.test_lab_guard import complete, scrape, wait_until
from tests.support.ports import free_port_block

pytestmark = pytest.mark.slow

CAPACITY_GB = {"big": 1.5, "small": 0.8}
LONG = 250_000  # fits the big node only
MID = 120_000  # fits either; three fit beside each other on the big node, one on the small one


def oom_lines(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if "NV_ERR_NO_MEMORY" in line]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lab-replicas")
    base = free_port_block(10)
    nodes = {name: (base + 2 * i, base + 2 * i + 1) for i, name in enumerate(CAPACITY_GB)}
    processes: list[Process] = []
    try:
        for name, (port, hook) in nodes.items():  # both start at once (start_node's command, its wait below)
            command = [sys.executable, "-m", "telemetry", "lab", "serve", *NODE_ARGS, "--capacity-gb",
                       repr(CAPACITY_GB[name]), "--time-scale", "0.01", "--host", "127.0.0.1", "--port", str(port),
                       "--memtel-port", str(hook), "--model-name", "lab"]
            processes.append(Process(command, tmp / f"node-{name}.log", FORECAST_ENV))
        for process, (name, (port, _hook)) in zip(processes, nodes.items(), strict=True):
            wait_healthy(f"http://127.0.0.1:{port}/health", process.process, timeout_s=120,
                         log_path=tmp / f"node-{name}.log", what="a lab node", error=AssertionError, interval_s=0.2)
        port, metrics = base + 4, base + 5
        replicas = [arg for name, (up, hook) in nodes.items()
                    for arg in ("--replica", f"http://127.0.0.1:{up}=http://127.0.0.1:{hook}")]
        guard = Process([sys.executable, "-m", "telemetry", "guard", *replicas, "--listen", f"127.0.0.1:{port}",
                         "--metrics-listen", f"127.0.0.1:{metrics}", "--queue-s", "60"], tmp / "guard.log")
        processes.append(guard)
        wait_healthy(f"http://127.0.0.1:{metrics}/metrics", guard.process, timeout_s=60, log_path=tmp / "guard.log",
                     what="the guard", error=AssertionError, interval_s=0.1)
        def in_pool() -> float | None:
            return scrape(f"http://127.0.0.1:{metrics}/metrics").get("memtel_guard_replica_in_pool")

        wait_until(lambda: in_pool() == 2, 60, "both replicas in the pool")
        yield {"url": f"http://127.0.0.1:{port}", "metrics": metrics, "nodes": nodes, "tmp": tmp, "base": base}
    finally:
        for process in reversed(processes):
            process.stop()


def prompt_tokens(port: int) -> float:
    return scrape(f"http://127.0.0.1:{port}/metrics").get("vllm:prompt_tokens_total", 0.0)


def burst(url: str, tokens: int, count: int, seed: int) -> list[int]:
    statuses: list[int] = [0] * count

    def send(i: int) -> None:
        statuses[i] = complete(url, tokens, seed + i)[0]

    threads = [threading.Thread(target=send, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return statuses


def test_long_prompts_go_to_the_big_node_a_burst_spreads_and_nothing_runs_out(lab):
    big, small = lab["nodes"]["big"][0], lab["nodes"]["small"][0]
    before = {port: prompt_tokens(port) for port in (big, small)}
    assert burst(lab["url"], LONG, 2, seed=1) == [200, 200]
    assert prompt_tokens(big) - before[big] == 2 * LONG and prompt_tokens(small) == before[small]
    # Four that fit either node: each goes where the most room is left, so the small one takes at least one.
    assert burst(lab["url"], MID, 4, seed=10) == [200] * 4
    got = {port: prompt_tokens(port) - before[port] for port in (big, small)}
    assert got[small] >= MID and got[big] >= 2 * LONG + MID and sum(got.values()) == 2 * LONG + 4 * MID
    for name in ("big", "small"):
        assert oom_lines(lab["tmp"] / f"node-{name}.log") == []


def test_a_burst_on_the_small_node_waits_and_all_complete(lab):
    small_port, small_hook = lab["nodes"]["small"]
    port, metrics = lab["base"] + 6, lab["base"] + 7
    guard = start_guard(port, small_port, [f"http://127.0.0.1:{small_hook}"], metrics, lab["tmp"] / "guard-small.log",
                        "--queue-s", "60")
    try:
        wait_until(lambda: (guard_limit(metrics) or 0) >= 100_000, 60, "the small node's limit")
        each = int(guard_limit(metrics) * 0.4)  # two fit beside each other, three do not
        # Without --queue-s the third is refused (test_lab_guard.py); with it, it waits and goes through.
        assert burst(f"http://127.0.0.1:{port}", each, 4, seed=20) == [200] * 4
        values = scrape(f"http://127.0.0.1:{metrics}/metrics")
        assert values.get("memtel_guard_queue_outcomes_total", 0) >= 1  # some waited
        assert values.get("memtel_guard_rejected_total", 0) == 0 and values.get("memtel_guard_queue_depth") == 0
        assert oom_lines(lab["tmp"] / "node-small.log") == []
    finally:
        guard.stop()
