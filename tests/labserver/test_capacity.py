"""`memtel lab serve --capacity-gb X`: a small lab node, its out-of-memory, and the longest prefill that fits.

Real lab servers on loopback (sim allocator, no host backing) with the live forecast on. Checked: the fit
budget is the node's capacity shared by its ranks; a prompt of exactly `memtel_forecast_max_prefill_tokens`
tokens is served; on one rank, a prompt one token longer than the gauge (read again from the state the first
request left) runs the node out of memory: 500 with vLLM's engine-dead answer, the driver-like
NV_ERR_NO_MEMORY line in the rank's log, the server exits as vLLM's does. On two ranks the gauge is a promise,
not the edge: each rank's allocator keeps its cache while the node has room, so whichever rank runs ahead may
take more than its half; the gauge counts on no cache being freed (docs/guard.md), so a prompt of exactly the
gauge is served however the ranks interleave (it failed about one run in three when the search counted on it),
and the longest prompt max-model-len allows, which cannot fit, fails the same way as on one rank.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.labserver.conftest import ROOT, LabServer
from tests.support.prom import metric

MIB = 1 << 20
SHAPE = ["--layers", "4", "--chunk", "1024", "--max-model-len", "65536", "--budget-mb", "64", "--compress-ratio", "4",
         "--scale", "1", "--time-scale", "0", "--no-unified-memory"]
ENV = {"MEMTEL_FORECAST_TOKENS": "4096", "MEMTEL_FORECAST_INTERVAL_S": "1"}
ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."


def fit_after(server: LabServer, rank: int, after: float, timeout: float = 30.0) -> tuple[int, int]:
    """(max prefill tokens, fit budget bytes) from a forecast of a snapshot taken after `after` (unix time)."""
    url = server.rank_url(rank)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        taken = metric(url, "memtel_forecast_last_success_timestamp_seconds")
        tokens = metric(url, "memtel_forecast_max_prefill_tokens")
        budget = metric(url, "memtel_forecast_fit_budget_bytes")
        if taken is not None and taken > after and tokens is not None and budget is not None:
            return int(tokens), int(budget)
        time.sleep(0.2)
    raise AssertionError(f"no fit from after {after} at {url}:\n{httpx.get(url, timeout=10).text[-1500:]}\n"
                         f"{server.log()}")


def complete(server: LabServer, tokens: int, word: str) -> httpx.Response:
    prompt = " ".join(f"{word}{i}" for i in range(tokens))   # its own words: no prefix-cache hit
    return httpx.post(server.url + "/v1/completions", timeout=120,
                      json={"model": "lab-stock", "prompt": prompt, "max_tokens": 1})


def wait_exit(server: LabServer, timeout: float = 20.0) -> int:
    try:
        return server.running.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the lab server did not stop after its engine died:\n{server.log()}") from None


def assert_died_of_out_of_memory(server: LabServer, response: httpx.Response) -> None:
    assert response.status_code == 500, response.text
    assert response.json()["error"] == {"message": ENGINE_DEAD, "type": "InternalServerError", "param": None,
                                        "code": 500}
    assert wait_exit(server) == 1
    log = server.log()
    assert "Out of memory [NV_ERR_NO_MEMORY] (0x00000051)" in log, log
    assert "Traceback" not in log, log


@pytest.mark.slow   # a lab server (about 10 s)
def test_one_rank_serves_exactly_the_gauge_and_runs_out_one_token_later(tmp_path: Path) -> None:
    capacity = 60 * MIB
    server = LabServer(tmp_path, *SHAPE, "--capacity-gb", str(capacity / (1 << 30)), ranks=1, env=ENV)
    with server:
        tokens, budget = fit_after(server, 0, 0)
        assert budget == capacity     # one rank: the whole node (nothing live, its cached bytes are its own)
        assert 1024 < tokens < 65536, tokens   # the test means something: neither nothing nor everything fits
        served = complete(server, tokens, "a")
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["prompt_tokens"] == tokens
        again, _ = fit_after(server, 0, time.time())   # from the state the request left
        assert again >= 1
        assert_died_of_out_of_memory(server, complete(server, again + 1, "b"))


@pytest.mark.slow   # a lab server of two ranks (about 10 s)
def test_two_ranks_share_the_node_serve_the_gauge_and_run_out_at_max_model_len(tmp_path: Path) -> None:
    capacity = 120 * MIB
    server = LabServer(tmp_path, *SHAPE, "--capacity-gb", str(capacity / (1 << 30)), ranks=2, env=ENV)
    with server:
        fits = [fit_after(server, rank, 0) for rank in range(2)]
        assert [budget for _, budget in fits] == [capacity // 2] * 2   # shared equally by the node's two ranks
        tokens = min(t for t, _ in fits)
        assert 1024 < tokens < 65536 - 1024, tokens
        served = complete(server, tokens, "a")
        assert served.status_code == 200, served.text
        again = min(fit_after(server, rank, time.time())[0] for rank in range(2))
        assert 1024 < again < 65536, again   # from the state the request left: still a real, cut range
        assert_died_of_out_of_memory(server, complete(server, 65536 - 1, "b"))   # max_tokens 1: the longest prompt


@pytest.mark.parametrize(("args", "expected"), [
    (["--allocator", "cuda", "--capacity-gb", "1"], "--capacity-gb 1 emulates a node's memory on the sim allocator"),
    (["--allocator", "sim", "--capacity-gb", "0"], "--capacity-gb"),
    (["--allocator", "sim", "--capacity-gb", "lots"], "--capacity-gb"),
])
def test_a_bad_capacity_is_one_line_and_exit_2(args: list[str], expected: str) -> None:
    run = subprocess.run([sys.executable, "-m", "telemetry", "lab", "serve", "--arm", "stock", "--port", "1", *args],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 2, run
    assert expected in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) <= 2, run.stderr   # argparse: usage + the one error line
