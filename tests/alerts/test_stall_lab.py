"""MemtelEngineStalled's evidence on a real server (issue 29): the lab server (`memtel lab serve`, simulator
allocator, its rank a separate process with memtel's hook) in a long prefill, its rank stopped with SIGSTOP while
its API keeps answering. What the rule reads must tell the two apart: during the prefill no token is counted but
hooked calls run; once stopped, /health still answers 200 and a request is still running, and nothing moves (the
hook's exporter, inside the stopped rank, does not answer: Prometheus sees its target down, no hooked call)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.ports import free_port_block

pytestmark = pytest.mark.slow

RUNNING, PROMPT, GENERATED = "vllm:num_requests_running", "vllm:prompt_tokens_total", "vllm:generation_tokens_total"
CALLS = "memtel_hook_calls_total"


def values(url: str, timeout: float = 2.0) -> dict[str, float]:
    """Each family's samples summed, by sample name."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=timeout).text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = check()
        except httpx.HTTPError:
            result = None
        if result:
            return result
        time.sleep(0.2)
    raise TimeoutError(what)


def test_a_stopped_rank_answers_health_but_nothing_moves_while_a_long_prefill_makes_hooked_calls(tmp_path):
    port = free_port_block(2)
    hook = port + 1
    base, hook_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{hook}/metrics"
    with open(tmp_path / "lab.log", "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "telemetry", "lab", "serve", "--arm", "stock", "--port", str(port),
             "--host", "127.0.0.1", "--model-name", "lab", "--allocator", "sim", "--ranks", "1",
             "--max-model-len", "65536", "--chunk", "1024", "--layers", "2", "--budget-mb", "64", "--scale", "0.05",
             "--time-scale", "10", "--no-unified-memory", "--memtel-port", str(hook)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    rank = None
    try:
        wait_for(lambda: httpx.get(base + "/health", timeout=1).status_code == 200, 120, "the lab server's /health")
        answer: dict[str, int] = {}

        def request() -> None:
            answer["status"] = httpx.post(base + "/v1/completions", timeout=300, json={
                "model": "lab", "prompt": "word " * 60000, "max_tokens": 4}).status_code

        client = threading.Thread(target=request)
        client.start()
        # The prefill runs: a request running, hooked calls counted, no prompt or generated token counted yet.
        first = wait_for(lambda: (v := values(hook_url)).get(CALLS, 0) > 0 and v, 60, "hooked calls in the rank")
        time.sleep(2)
        progress = values(hook_url)
        metrics = values(base + "/metrics")
        assert metrics[RUNNING] == 1 and metrics[PROMPT] == 0 and metrics[GENERATED] == 0, metrics
        assert progress[CALLS] > first[CALLS], "a long prefill makes hooked calls all along"

        (rank,) = [p for p in psutil.Process(server.pid).children(recursive=True)
                   if "multiprocessing.spawn" in " ".join(p.cmdline())]
        rank.send_signal(signal.SIGSTOP)
        time.sleep(1)
        stopped = values(base + "/metrics")
        for _ in range(5):
            time.sleep(1)
            assert httpx.get(base + "/health", timeout=2).status_code == 200  # the API keeps answering
            now = values(base + "/metrics")
            assert now[RUNNING] == 1 and now[PROMPT] == stopped[PROMPT] and now[GENERATED] == stopped[GENERATED]
        with pytest.raises(httpx.TimeoutException):  # the hook's exporter is in the stopped rank
            httpx.get(hook_url, timeout=1.0)

        rank.send_signal(signal.SIGCONT)
        client.join(timeout=240)
        assert answer.get("status") == 200
        done = values(base + "/metrics")
        assert done[PROMPT] == 60000 and done[GENERATED] > 0 and values(hook_url)[CALLS] > progress[CALLS]
    finally:
        if rank is not None and rank.is_running():
            rank.send_signal(signal.SIGCONT)
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)
