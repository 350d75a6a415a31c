"""Starting, stopping and failing: no rank outlives its server; bad flags and ports fail clearly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from harness.labserver.cost_model import CostModel
from telemetry.model.indexer.planner import plan_prefill
from telemetry.model.indexer.shape import MIB, REFERENCE_SHAPE, IndexerShape
from tests.labserver.conftest import SMALL, LabServer, started
from tests.support.prom import metric


def _ranks(server: LabServer) -> list[psutil.Process]:
    return [p for p in psutil.Process(server.running.pid).children() if "spawn_main" in " ".join(p.cmdline())]


def _gone(processes: list[psutil.Process], timeout: float = 10.0) -> bool:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    return not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


TTFT_ARGS = ["--layers", "45", "--chunk", "2048", "--max-model-len", "65536", "--budget-mb", "512", "--scale", "0.01",
             "--time-scale", "0.05"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LabServer]]:
    """A server for each test below that needs one of its own (three end its life), all started at once."""
    tmp = tmp_path_factory.mktemp("lifecycle")
    named = {"killed": LabServer(tmp, *SMALL), "dead rank": LabServer(tmp, *SMALL), "sigterm": LabServer(tmp, *SMALL),
             "ttft": LabServer(tmp, *TTFT_ARGS)}
    with started(*named.values()):
        yield named


def test_ranks_die_with_a_killed_server(servers):
    server = servers["killed"]
    try:
        ranks = _ranks(server)
        assert len(ranks) == 2
        server.running.kill()  # SIGKILL: the server runs no cleanup at all
        server.running.wait()
        assert _gone(ranks), [p.pid for p in ranks if p.is_running()]
    finally:
        server.stop()


def test_a_dead_rank_makes_the_server_unhealthy_and_exit(servers):
    server = servers["dead rank"]
    try:
        ranks = _ranks(server)
        ranks[1].kill()
        deadline = time.monotonic() + 10
        codes: list[int | None] = []
        while time.monotonic() < deadline and server.running.poll() is None:
            try:
                codes.append(httpx.get(server.url + "/health", timeout=2).status_code)
            except httpx.HTTPError:
                codes.append(None)
            time.sleep(0.1)
        assert server.running.wait(10) == 1
        assert "rank 1" in server.log() and "exited" in server.log()
        assert _gone(ranks)
    finally:
        server.stop()


def test_sigterm_stops_the_server_and_its_ranks(servers):
    server = servers["sigterm"]
    try:
        ranks = _ranks(server)
        server.running.send_signal(signal.SIGTERM)  # the server alone, not its group
        assert server.running.wait(15) == 0
        assert _gone(ranks, 5)
    finally:
        server.stop()


def _memtel(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "telemetry", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, expected", [
    (["lab", "serve", "--arm", "bogus"], "invalid choice: 'bogus'"),
    (["lab", "serve", "--arm", "stock", "--scale", "2"], "expected a number in (0, 1], got 2.0"),
    (["lab", "serve", "--arm", "stock", "--ranks", "0"], "expected a positive integer, got 0"),
    (["lab", "serve", "--arm", "stock", "--budget-mb", "-1", "--allocator", "sim"],
     "the logits budget must hold at least one float32 (4 bytes), got -1.0 MiB"),
    (["lab", "serve", "--arm", "stock", "--budget-mb", "lots"], "expected a number of MiB such as 512 or 96.5"),
    (["lab"], "usage: memtel lab serve"),
])
def test_bad_flags_fail_with_a_clear_message(args, expected):
    result = _memtel(*args)
    assert result.returncode == 2
    assert expected in result.stderr


def test_a_port_in_use_fails_before_any_rank_starts():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        before = {p.pid for p in psutil.process_iter()}
        result = _memtel("lab", "serve", "--arm", "stock", "--allocator", "sim", "--port", str(port))
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    spawned = [p for p in psutil.process_iter(["cmdline"]) if p.pid not in before
               and "spawn_main" in " ".join(p.info["cmdline"] or []) and p.ppid() == os.getpid()]
    assert spawned == []


def test_simulated_ttft_grows_with_the_work(servers):
    shape = IndexerShape(layers=45, chunk=2048, max_model_len=65536, logits_budget_bytes=512 * MIB)
    cost = CostModel(time_scale=0.05)

    def modeled(tokens: int) -> float:
        return sum(cost.prefill_step_s(step.rows, sum(launch.computed_elements for launch in launches),
                                       len(launches), shape.layers)
                   for step, launches in plan_prefill(tokens, shape, "stock"))

    server = servers["ttft"]
    ttft = {}
    for tokens in (2048, 16384):
        before = (metric(server.url + "/metrics", "vllm:time_to_first_token_seconds_sum") or 0.0)
        response = httpx.post(server.url + "/v1/completions", timeout=60,
                              json={"prompt": " ".join(f"t{tokens}w{i}" for i in range(tokens)), "max_tokens": 1})
        assert response.status_code == 200
        after = metric(server.url + "/metrics", "vllm:time_to_first_token_seconds_sum")
        assert after is not None
        ttft[tokens] = after - before
    for tokens, seconds in ttft.items():
        assert modeled(tokens) <= seconds <= modeled(tokens) + 0.5, (tokens, seconds, modeled(tokens))
    # 8x the tokens, and the logits grow with the kv length: the time grows with the modeled work (a busy
    # machine adds a constant, not a share).
    assert ttft[16384] - ttft[2048] >= 0.9 * (modeled(16384) - modeled(2048)) > 0


def test_cost_model_is_calibrated_to_the_reference_prefill():
    """A cold 100k-token prefill, 45 layers, 8,192-token chunks, ratio 4: about 54 s, as measured by the user."""
    cost = CostModel()
    for mode in ("stock", "fixed"):
        seconds = sum(cost.prefill_step_s(step.rows, sum(launch.computed_elements for launch in launches),
                                          len(launches), REFERENCE_SHAPE.layers)
                      for step, launches in plan_prefill(100_000, REFERENCE_SHAPE, mode))
        assert 51.0 < seconds < 57.0, (mode, seconds)
    with pytest.raises(ValueError, match="time_scale must be >= 0"):
        CostModel(time_scale=-1)
