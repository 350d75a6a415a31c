"""`memtel tune --hook` against a real hook process on the CPU (the lab's simulator as its allocator): with no
shape, memory or settings flags it takes what the hook knows (workload, scale, settings, fit budget, history),
and the figure it prints for today's setting is the hook's gauge, memtel_forecast_max_prefill_tokens."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import call_main
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
SPACE = ["--expandable-segments", "False,True", "--max-split-mb", "none,256", "--roundup", "none",
         "--gc-threshold", "none", "--budgets-mb", "2048", "--chunks", "4096", "--modes", "stock"]


@pytest.fixture(scope="module")
def hook() -> Iterator[dict]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tests.tune.hook_gauge_process", "--port", str(port)],
                               cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        deadline = time.monotonic() + 90
        line = ""
        while not line and time.monotonic() < deadline and process.poll() is None:
            ready, _, _ = select.select([process.stdout], [], [], 0.5)
            if ready:
                line = process.stdout.readline()
        assert line, f"the hook process said nothing: {process.poll()}"
        out = json.loads(line)
        assert "error" not in out, out
        yield out
    finally:
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


@pytest.mark.slow   # about 12 s: the hook process's state and forecast, then the search
def test_todays_figure_is_the_hooks_gauge(hook: dict) -> None:
    done = call_main(["tune", "--hook", f"127.0.0.1:{hook['port']}", "--target-tokens", "16384", *SPACE])
    assert done.returncode == 0, done.stderr
    assert f"the hook's gauge (memtel_forecast_max_prefill_tokens) at its last fit: {hook['gauge']:,}" in done.stdout
    assert "rows x 0.5" in done.stdout and "the hook's fit budget" in done.stdout      # its scale and budget
    now = next(line for line in done.stdout.splitlines() if line.lstrip().startswith("now "))
    assert now.split()[1] == f"{hook['gauge']:,}"                                    # today's figure = the gauge
    assert hook["gauge"] < 262_144                                                   # an edge, not "all fits"
    assert "max_split_size_mb:256; budget 2048 MiB; chunk 4,096; stock" in now       # the hook's settings, shape
    assert "history: " in done.stdout and "at most" not in done.stdout              # and its history


def test_a_hook_serving_a_bad_forecast_is_one_line() -> None:
    from prometheus_client import CollectorRegistry

    from telemetry.hook.exporter import start_exporter
    from telemetry.hook.forecast.published import publish

    segments = [{"device": 0, "address": 2**40, "total_size": 2 * 2**20, "stream": 0, "segment_type": "large",
                 "segment_pool_id": [0, 0], "is_expandable": False,
                 "blocks": [{"address": 2**40, "size": 2 * 2**20, "state": "active_allocated"}]}]
    server = start_exporter(CollectorRegistry(), "127.0.0.1", 0, snapshot=lambda: (segments, 0))
    publish(lambda: {"shape": {"layers": -3}, "mode": "stock", "alloc_conf": "", "limit_bytes": 1,
                     "max_fit_tokens": 0})
    try:
        done = call_main(["tune", "--hook", f"127.0.0.1:{server.port}", "--target-tokens", "100", *SPACE])
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert "the forecast it serves has a missing or bad field" in done.stderr
        publish(None)
        done = call_main(["tune", "--hook", f"127.0.0.1:{server.port}", "--target-tokens", "100", *SPACE])
        assert done.returncode == 2 and "serves no fit budget" in done.stderr and done.stderr.count("\n") == 1
    finally:
        publish(None)
        server.stop()
