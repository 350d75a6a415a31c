"""The hook's live forecast in the lab server's ranks, end to end through the real exporters.

`memtel lab serve --allocator sim` with MEMTEL_FORECAST_TOKENS set: each rank's hook forecasts, from the
rank's own simulator (its snapshot, under the backend's lock), the next prefill of each length with the
rank's own workload. Checked: at rest the exported forecast equals `memtel forecast` on the same (empty)
state with the same shape; then for each length in turn, the forecast made from the idle rank before a
real request of that many tokens equals, exactly, what the request added to every rank (reserved growth and
device allocs, read from the same exporters).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.labserver.conftest import ROOT, LabServer, started
from tests.support.prom import metric

SHAPE = ["--layers", "4", "--chunk", "1024", "--max-model-len", "65536", "--budget-mb", "64", "--compress-ratio", "4"]
LENGTHS = (3000, 9000)
ENV = {"MEMTEL_FORECAST_TOKENS": ",".join(map(str, LENGTHS)), "MEMTEL_FORECAST_INTERVAL_S": "1"}
SITE = "telemetry.model.indexer.launch:indexer_logits_launch"


def forecast_of(url: str) -> dict[int, tuple[float | None, ...]]:
    return {n: tuple(metric(url, f"memtel_forecast_{name}", {"tokens": str(n)})
                     for name in ("reserved_growth_bytes", "peak_reserved_bytes", "device_alloc"))
            for n in LENGTHS}


def fresh_forecast(url: str, after: float, timeout: float = 30.0) -> dict[int, tuple[float | None, ...]]:
    """The rank's forecast from a snapshot taken after `after` (unix time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        taken = metric(url, "memtel_forecast_last_success_timestamp_seconds")
        if taken is not None and taken > after:
            values = forecast_of(url)
            if all(v is not None for vs in values.values() for v in vs):
                return values
        time.sleep(0.2)
    raise AssertionError(f"no forecast from after {after} at {url}:\n{httpx.get(url, timeout=10).text[-3000:]}")


def allocator(url: str) -> tuple[float, float]:
    labels = {"site": SITE}
    reserved = metric(url, "memtel_allocator_reserved_bytes", labels)
    allocs = metric(url, "memtel_allocator_device_alloc_total", labels)
    assert reserved is not None and allocs is not None
    return reserved, allocs


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LabServer]]:
    """The two servers of the tests below, started at once: with the live forecast, and with a bad setting."""
    tmp = tmp_path_factory.mktemp("live-forecast")
    args = (*SHAPE, "--scale", "1", "--time-scale", "0", "--no-unified-memory")
    named = {"forecast": LabServer(tmp, *args, env=ENV),
             "bad setting": LabServer(tmp, *args, env={"MEMTEL_FORECAST_TOKENS": "100k"})}
    with started(*named.values()):
        yield named


def test_the_ranks_forecast_what_the_next_request_adds(tmp_path, servers):
    server = servers["forecast"]
    urls = [server.rank_url(rank) for rank in range(server.ranks)]
    at_rest = [fresh_forecast(url, 0) for url in urls]

    # `memtel forecast` from the same state (a rank that has allocated nothing: no segments), same shape.
    snapshot = tmp_path / "empty-snapshot.json"
    snapshot.write_text("[]")
    cli = subprocess.run([sys.executable, "-m", "telemetry", "forecast", "--snapshot", str(snapshot), "--tokens",
                          ",".join(map(str, LENGTHS)), *SHAPE, "--json"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert cli.returncode == 0, cli.stderr
    expected = {f["tokens"]: (f["reserved_growth_bytes"], f["peak_reserved_bytes"], f["num_device_alloc"])
                for f in json.loads(cli.stdout)["forecasts"]}
    for forecast in at_rest:
        assert forecast == expected, (forecast, expected)
    info = metric(urls[0], "memtel_forecast_workload_info", {"source": "program", "mode": "stock", "layers": "4",
                                                             "chunk": "1024", "max_model_len": "65536"})
    assert info == 1

    forecasts = at_rest
    for index, tokens in enumerate(LENGTHS):
        before = [allocator(url) for url in urls]
        prompt = " ".join(f"r{index}w{i}" for i in range(tokens))   # no prefix shared with another request
        response = httpx.post(server.url + "/v1/completions", timeout=120,
                              json={"model": "lab-stock", "prompt": prompt, "max_tokens": 1})
        response.raise_for_status()
        assert response.json()["usage"]["prompt_tokens"] == tokens
        done = time.time()
        for rank, url in enumerate(urls):
            reserved, allocs = allocator(url)
            growth = reserved - before[rank][0]
            assert (growth, allocs - before[rank][1]) == (forecasts[rank][tokens][0], forecasts[rank][tokens][2]), \
                (rank, tokens, forecasts[rank])
            assert reserved <= forecasts[rank][tokens][1]   # the peak is at least where it ended
            # Both grow: the second from the state the first left (a seeded forecast, not an empty one).
            assert growth > 0, f"request {index} grew nothing: the check proved nothing"
        forecasts = [fresh_forecast(url, done) for url in urls]
    for url in urls:
        assert metric(url, "memtel_forecast_failures_total") is None, httpx.get(url, timeout=10).text


def test_a_bad_forecast_setting_is_one_line_per_rank_and_the_ranks_serve_without_it(servers):
    server = servers["bad setting"]
    response = httpx.post(server.url + "/v1/completions", timeout=120,
                          json={"model": "lab-stock", "prompt": "a b c d", "max_tokens": 1})
    response.raise_for_status()
    for rank in range(server.ranks):
        url = server.rank_url(rank)
        assert metric(url, "memtel_hook_calls_total") is not None   # the hook runs
        assert "memtel_forecast_" not in httpx.get(url, timeout=10).text
    lines = [line for line in server.log().splitlines() if "MEMTEL_FORECAST_TOKENS='100k'" in line]
    assert len(lines) == server.ranks, lines
    assert all("'100k' is not a token count" in line and "the live forecast is off" in line for line in lines)
    assert "Traceback" not in server.log()
