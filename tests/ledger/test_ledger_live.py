"""`memtel ledger` and `memtel top` against real daemons on two loopback "nodes" (127.0.0.2 and 127.0.0.3) and
real hooked processes with an engine-like worker (tests/ledger/engine_process.py): what they print is checked
against what the processes allocated and against the daemons' own figures; `memtel top` is driven in a real
terminal (tmux) with its keys."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.ports import free_port, free_port_block

ROOT = Path(__file__).resolve().parents[2]
NODES = ("127.0.0.2", "127.0.0.3")

pytestmark = pytest.mark.slow


def memtel(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "telemetry", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Pair:
    def __init__(self) -> None:
        self.daemons: dict[str, str] = {}
        self.hooks: dict[str, str] = {}
        self.expected: dict[str, dict[str, int]] = {}
        self.pids: dict[str, int] = {}


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Iterator[Pair]:
    result = Pair()
    procs: list[subprocess.Popen] = []
    logs = []
    base = tmp_path_factory.mktemp("ledger")
    try:
        engines = {}
        for node in NODES:
            port = free_port_block(2)   # one block: two free_port() calls can return the same port
            hook_port = port + 1
            state = base / node
            state.mkdir()
            log = open(base / f"daemon-{node}.log", "wb")  # noqa: SIM115 - closed with the process
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, "-m", "telemetry", "daemon", "--listen", f"{node}:{port}",
                                           "--state-dir", str(state)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
            result.daemons[node] = f"http://{node}:{port}/metrics"
            engine = subprocess.Popen([sys.executable, "-m", "tests.ledger.engine_process", str(hook_port), node,
                                       "64" if node == NODES[0] else "128"], cwd=ROOT, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            procs.append(engine)
            engines[node] = engine
            result.hooks[node] = f"http://{node}:{hook_port}/metrics"
        for node, engine in engines.items():
            assert engine.stdout is not None
            result.expected[node] = json.loads(engine.stdout.readline())
            result.pids[node] = engine.pid
        import urllib.request

        def answers(url: str) -> bool:
            try:
                with urllib.request.urlopen(url, timeout=1) as response:
                    return b"memtel_engine_kv_cache_bytes" in response.read() or "9101" not in url
            except OSError:
                return False

        for url in [*result.daemons.values(), *result.hooks.values()]:
            wait_for(lambda u=url: answers(u), 30, url)
        yield result
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()
        for log in logs:
            log.close()


def test_ledger_json_for_a_pair_of_nodes(pair):
    result = memtel("ledger", "--daemon", ",".join(pair.daemons.values()), "--hooks", ",".join(pair.hooks.values()),
                    "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [n["node"] for n in report["nodes"]] == list(NODES)
    for node in report["nodes"]:
        lines = node["lines"]
        parts = [lines[k] for k in ("page_cache", "other_host", "unexplained")]
        assert None not in parts and sum(parts) == lines["used"] > 0     # it adds up
        assert lines["gpu_processes"] is None and node["unified_memory"] is None   # no NVIDIA driver here
        assert node["headroom_bytes"] is not None and node["contiguous_free_bytes"] is not None
        (process,) = node["processes"]
        want = pair.expected[node["node"]]
        assert process["hook"] == pair.hooks[node["node"]] and process["error"] is None
        assert process["pid"] == pair.pids[node["node"]] and process["rank"] == 0  # numbers, for scripts
        assert (process["weights"], process["kv_cache"]) == (want["weights_bytes"], want["kv_cache_bytes"])
        assert process["host_rss"] > 0
        # a CPU process: no allocator, so these are unknown (null), never 0
        assert process["allocator_cache"] is None and process["outside"] is None and process["live_other"] is None
    # the two nodes' KV caches differ (64 and 128 blocks): each hook landed on its own node
    kv = [n["processes"][0]["kv_cache"] for n in report["nodes"]]
    assert kv[1] == 2 * kv[0]


def test_ledger_says_what_it_cannot_reach_and_exits_1(pair):
    dead = f"http://127.0.0.2:{free_port()}/metrics"
    result = memtel("ledger", "--daemon", pair.daemons[NODES[0]], "--hooks", f"{pair.hooks[NODES[0]]},{dead}")
    assert result.returncode == 1
    assert f"hook {dead}: unreachable (Connection refused)" in result.stdout
    assert "weights" in result.stdout and " 0 " not in result.stdout.split(dead)[1]


def test_ledger_bad_url_is_one_line_and_exit_2():
    result = memtel("ledger", "--daemon", "ftp://x:1")
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and "not a metrics URL" in result.stderr


def test_top_once_prints_one_frame_of_80_columns(pair):
    result = memtel("top", "--once", "--daemon", ",".join(pair.daemons.values()),
                    "--hooks", ",".join(pair.hooks.values()))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("memtel top") and all(len(line) <= 80 for line in lines)
    assert sum(line.startswith("node ") for line in lines) == 2 and "headroom" in result.stdout


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=10, check=True).stdout


def test_top_in_a_real_terminal_with_its_keys(pair, tmp_path):
    if shutil.which("tmux") is None:
        pytest.fail("tmux is missing: scripts/test installs it (Debian's tmux)")
    session = f"memtel-top-{free_port()}"
    dead = f"127.0.0.3:{free_port()}"
    command = (f"cd {ROOT} && TERM=xterm-256color {sys.executable} -m telemetry top --daemon "
               f"{','.join(pair.daemons.values())} --hooks {','.join(pair.hooks.values())},{dead}")
    tmux("new-session", "-d", "-s", session, "-x", "80", "-y", "24", command)
    try:
        def screen() -> str:
            return tmux("capture-pane", "-p", "-t", session)

        def showing(*texts: str):
            def check() -> str | None:
                text = screen()
                return text if all(t in text for t in texts) else None
            return check

        first = wait_for(showing("memtel top", "rank"), 30, "a frame")
        assert "sort: rank" in first and f"hook http://{dead}/metrics: unreachable" in first
        assert all(len(line) <= 80 for line in first.splitlines()) and len(first.splitlines()) <= 24
        tmux("send-keys", "-t", session, "s")
        wait_for(lambda: "sort: reserved" in screen(), 10, "the next sort after 's' (rank -> reserved)")
        tmux("send-keys", "-t", session, "p")
        paused = wait_for(showing("PAUSED"), 10, "PAUSED after 'p'")
        stamp = paused.splitlines()[0].split()[2]
        time.sleep(1.5)   # paused: the frame's time must not move
        assert screen().splitlines()[0].split()[2] == stamp
        tmux("send-keys", "-t", session, "q")
        wait_for(lambda: subprocess.run(["tmux", "has-session", "-t", session], capture_output=True).returncode != 0,
                 10, "top to exit after 'q'")
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
