"""`memtel tune --hook`: the hook exporter's /snapshot route and the fetch side's limits, in-process (one exporter
per test on 127.0.0.1, port 0), and torch 2.11's rule for max_split_size_mb."""

from __future__ import annotations

import http.client
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from telemetry.cli import main
from telemetry.errors import ConfigError, RunError
from telemetry.hook.exporter import snapshot_answer, start_exporter
from telemetry.model.allocsim.config import AllocatorConfigError, parse_alloc_conf
from telemetry.model.allocsim.snapshot import read_allocator_state
from telemetry.model.fitsearch.space import SearchSpace, expand
from telemetry.model.indexer.backends import SimBackend
from telemetry.model.indexer.shape import MIB, IndexerShape
from telemetry.tune.hook_snapshot import fetch_snapshot, hook_endpoint

LIMITS = {"device": None, "max_bytes": 1 << 20, "max_objects": 100_000, "max_blocks": 10_000}


def sim_segments() -> list[dict]:
    backend = SimBackend("")
    held = [backend.alloc(n * MIB) for n in (1, 30, 64, 2, 12)]
    backend.release(held[1])
    return backend.snapshot()


@pytest.fixture
def serve():
    servers = []

    def start(provider=None, host="127.0.0.1"):
        kwargs = {} if provider is None else {"snapshot": provider}
        server = start_exporter(CollectorRegistry(), host, 0, **kwargs)
        servers.append(server)
        return server
    yield start
    for server in servers:
        server.stop()


def get(port: int, path: str) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_a_hook_serves_its_allocator_state_and_tune_reads_it(serve) -> None:
    segments = sim_segments()
    server = serve(lambda: (segments, 0))
    state, path = fetch_snapshot(f"127.0.0.1:{server.port}", **LIMITS)
    try:
        want = read_allocator_state(segments)
        assert state.counters == want.counters and len(state.segments) == len(want.segments)
        assert read_allocator_state(__import__("json").loads(path.read_text())).counters == want.counters
    finally:
        path.unlink()
    status, _ = get(server.port, "/metrics")   # the other routes are as they were
    assert status == 200


def test_without_cuda_the_route_says_so_and_tune_gives_one_line(serve, capsys) -> None:
    server = serve()   # the hook's own reader: no CUDA device bound in this process
    status, body = get(server.port, "/snapshot")
    assert status == 503 and b"no CUDA device bound" in body and body.count(b"\n") == 1
    code = main(["tune", "--hook", f"http://127.0.0.1:{server.port}/metrics", "--target-tokens", "100",
                 "--memory-gb", "1"])
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1 and "Traceback" not in err
    assert "HTTP 503" in err and "no hooked call has run on a CUDA device" in err and "/snapshot" in err


def test_the_snapshot_is_not_served_on_a_public_address_without_a_login(serve) -> None:
    server = serve(lambda: (sim_segments(), 0), host="0.0.0.0")
    status, body = get(server.port, "/snapshot")
    assert status == 403 and b"loopback" in body


def test_limits_on_both_sides(serve) -> None:
    segments = sim_segments()
    status, body, _ = snapshot_answer(lambda: (segments, 0), max_blocks=3)
    assert status == 413 and b"over the 3 this exporter serves" in body
    server = serve(lambda: (segments, 0))
    with pytest.raises(RunError, match=r"^--hook http://127\.0\.0\.1:\d+/snapshot: body of [\d,]+ bytes, over"):
        fetch_snapshot(f"127.0.0.1:{server.port}", **{**LIMITS, "max_bytes": 200})
    with pytest.raises(ConfigError, match="segments and blocks"):
        fetch_snapshot(f"127.0.0.1:{server.port}", **{**LIMITS, "max_blocks": 3})
    hostile = serve(lambda: ([{"address": "x", "blocks": [{"size": -1}]}], 0))
    with pytest.raises(ConfigError):
        fetch_snapshot(f"127.0.0.1:{hostile.port}", **LIMITS)


def test_hook_urls() -> None:
    assert hook_endpoint("localhost").url == "http://localhost:9200/snapshot"
    assert hook_endpoint("https://u:p@h:9201/metrics").path == "/snapshot"
    with pytest.raises(ConfigError, match=r"^--hook: "):
        hook_endpoint("not a url at all")


def test_max_split_size_follows_torch_2_11() -> None:
    """Measured on the H200 with torch 2.11.0 (BENCHMARKS.md, tune): 19 is refused ("must be >= 20"), 20 and 21
    are accepted, from the environment and at run time."""
    with pytest.raises(AllocatorConfigError, match="max_split_size_mb too small, must be >= 20, got 19"):
        parse_alloc_conf("max_split_size_mb:19")
    assert parse_alloc_conf("max_split_size_mb:20").max_split_size == 20 * MIB
    shape = IndexerShape(layers=1, chunk=1024, max_model_len=4096)
    settings = expand(SearchSpace(max_split_size_mb=(20,)), shape, "").settings
    assert settings and all("max_split_size_mb:20" in s.alloc_conf for s in settings)


def test_the_cuda_probe_needs_the_fraction_cap(tmp_path: Path) -> None:
    from telemetry.model.fitsearch.search import Outcome, Problem
    from telemetry.model.fitsearch.space import process_setting
    from telemetry.model.fitsearch.verify import SnapshotSource, verify

    state = read_allocator_state(sim_segments())
    shape = IndexerShape(layers=1, chunk=1024, max_model_len=4096)
    problem = Problem(state, shape, 1 << 30, 100)
    with pytest.raises(RunError, match="--cap fraction"):
        verify(problem, SnapshotSource(str(tmp_path), None, 1, 1, 1),
               [Outcome(process_setting(shape, "", "stock"), 1)], "cuda")


def test_when_the_top_fits_max_model_len_more_launches_are_ruled_out_unscreened() -> None:
    """With memory to spare, the top fills with settings that fit max-model-len; the rest with more launches
    are ruled out without a screen, and the top is the brute force's to the last field of the rank."""
    from telemetry.model.allocsim.snapshot import load_allocator_state
    from telemetry.model.fitsearch.search import Outcome, Problem, evaluate, tune
    from telemetry.model.fitsearch.space import process_setting

    from .test_tune import SHAPE, SMALL_SPACE, SNAPSHOT

    state = load_allocator_state(SNAPSHOT)
    problem = Problem(state, SHAPE, 8 * 1024**3, 20_000)
    expanded = expand(SMALL_SPACE, SHAPE, "")
    result = tune(problem, expanded, process_setting(SHAPE, "", "stock"), top=3)
    brute = sorted((evaluate(problem, s) for s in expanded.settings), key=Outcome.rank_key)
    assert [o.rank_key() for o in result.ranked] == [o.rank_key() for o in brute[:3]]
    assert result.best.fit_tokens == SHAPE.max_model_len
    unscreened = [o for o in result.pruned if o.pruned and o.pruned.startswith("more launches")]
    assert unscreened and all(o.launches > result.ranked[-1].launches for o in unscreened)
