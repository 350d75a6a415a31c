"""Real vLLM servers shared by the tests of one pytest session: each launch started once, in parallel, stopped early.

A vLLM CPU server takes 40 to 50 s to start on two cores, most of it importing torch and vLLM one process after
another (API server, engine core, worker), so the real-vLLM tests share a server wherever their assertions allow:

- `vllm_counting`: vLLM's default start (compiled, API server, engine core and worker processes) with memtel's
  plugin counting the CPU attention target, shape records on, chunks of `CHUNK` tokens, no prefix caching, and a
  plain chat template. The hook tests read deltas around their own requests; the guard's tests are its clients.
- `vllm_indexer`: the plugin hooking only the sparse-indexer preset, which a Llama never runs, with the live forecast
  on: the hook must still say so, listen and open its log though no target ever fires (nothing may ever call a
  target here, so it cannot be the counting server). Started cheaply (`--enforce-eager`, the worker inside the
  engine core): its tests assert nothing about compilation or the process layout.
- `vllm_under_run`: `memtel run` with vLLM's plugins off (`VLLM_PLUGINS=`), a different launch by nature. Eager,
  but with vLLM's default process layout, which its test asserts on.

The first test that asks for any of them starts every launch some selected test needs, all at once: the starts
are mostly one-core work (imports, model set-up), so two of them overlap on two cores. A thread per launch polls
its /health from the start, so `healthy_at` is when it became healthy, not when a test first asked. A launch is
stopped (its process group) right after the teardown of the last selected test that uses it (`teardown_done`,
from tests/conftest.py's teardown hook), and every launch still running when the session ends. Only tests marked
`vllm` may use them: the fast tier never starts vLLM.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.support.ports import free_port, free_port_block
from tests.support.vllm import VllmServer, vllm_python

TARGET = "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward"
INDEXER = "vllm.model_executor.layers.sparse_attn_indexer:fp8_fp4_mqa_logits"
# The counting and run servers' --max-num-batched-tokens: small enough that a test prompt runs in several chunks,
# large enough that the guard's 3,000-token prompts do not take a hundred steps.
CHUNK = 128
INDEXER_CHUNK = 48     # the indexer server's, so its forecast line names a value of its own
INDEXER_MAX_MODEL_LEN = 8192
UNRESOLVED_AFTER_S = 5   # memtel run's --unresolved-after on the run server
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant{% endif %}")


@dataclass
class SharedVllm:
    """One launch: the server, its hook's exporter port and call-log directory, and when it started and was healthy."""

    name: str
    server: VllmServer
    directory: Path
    hook_port: int
    log_dir: Path
    started_at: float = 0.0
    healthy_at: float | None = None   # when its /health first answered (watched from the start, not when first used)
    start_error: BaseException | None = None
    watcher: threading.Thread | None = None
    calls_at_stop: float | None = None   # memtel_hook_calls_total (all sites) scraped right before the stop
    after_stop: list[Callable[[], None]] = field(default_factory=list)   # checks a test leaves for after the stop
    stopped: bool = False

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.server.start()
        self.watcher = threading.Thread(target=self._watch, name=f"{self.name}-health", daemon=True)
        self.watcher.start()

    def _watch(self) -> None:
        try:   # three starts at once on two busy cores: allow twice one start's usual bound
            self.server.wait_healthy(timeout=600.0)
            self.healthy_at = time.monotonic()
        except BaseException as error:   # handed to the test by ready()
            self.start_error = error

    def ready(self) -> SharedVllm:
        assert self.watcher is not None, "start() first"
        self.watcher.join()
        if self.healthy_at is None:
            self.stop(run_checks=False)
            raise self.start_error or RuntimeError(f"{self.name}: vLLM did not become healthy")
        return self

    def stop(self, *, run_checks: bool = True) -> None:
        """Stop the server's process group (once); then run the checks tests left in `after_stop`."""
        if self.stopped:
            return
        self.stopped = True
        if self.healthy_at is not None:
            try:
                text = httpx.get(f"http://127.0.0.1:{self.hook_port}/metrics", timeout=5).text
                self.calls_at_stop = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                         if line.startswith("memtel_hook_calls_total{"))
            except httpx.HTTPError:
                pass
        self.server.stop()
        if run_checks:
            for check in self.after_stop:
                check()


def _counting(directory: Path, model: Path) -> SharedVllm:
    hook_port, log_dir = free_port_block(4), directory / "memtel"
    template = directory / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    env = {"MEMTEL_TARGETS": TARGET, "MEMTEL_PORT": str(hook_port), "MEMTEL_ADDR": "127.0.0.1",
           "MEMTEL_LOG_DIR": str(log_dir), "MEMTEL_RECORD_SHAPE": "1"}
    server = VllmServer(model, free_port(), env=env, log_path=directory / "vllm.log", max_model_len=8192,
                        extra_args=("--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "4",
                                    "--no-enable-prefix-caching", "--chat-template", str(template)))
    return SharedVllm("vllm_counting", server, directory, hook_port, log_dir)


def _indexer(directory: Path, model: Path) -> SharedVllm:
    hook_port, log_dir = free_port_block(2), directory / "memtel"
    env = {"MEMTEL_TARGETS": "vllm-sparse-indexer", "MEMTEL_PORT": str(hook_port), "MEMTEL_ADDR": "127.0.0.1",
           "MEMTEL_LOG_DIR": str(log_dir), "MEMTEL_FORECAST_TOKENS": "100000,200000",
           "MEMTEL_FORECAST_INTERVAL_S": "1",
           # With this, the CPU platform keeps `uni`: the worker runs inside the engine core process (one import of
           # torch and vLLM fewer); the OpenAI server keeps its engine core in a process of its own either way.
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    server = VllmServer(model, free_port(), env=env, log_path=directory / "vllm.log",
                        max_model_len=INDEXER_MAX_MODEL_LEN,
                        extra_args=("--max-num-batched-tokens", str(INDEXER_CHUNK), "--max-num-seqs", "4",
                                    "--enforce-eager", "--distributed-executor-backend", "uni"))
    return SharedVllm("vllm_indexer", server, directory, hook_port, log_dir)


def _under_run(directory: Path, model: Path) -> SharedVllm:
    hook_port, log_dir = free_port_block(4), directory / "memtel"
    runtime = directory / "xdg"
    runtime.mkdir(mode=0o700)
    server = VllmServer(model, free_port(), log_path=directory / "vllm.log",
                        env={"VLLM_PLUGINS": "", "MEMTEL_ADDR": "127.0.0.1", "MEMTEL_RECORD_SHAPE": "1",
                             "XDG_RUNTIME_DIR": str(runtime)},
                        extra_args=("--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "4",
                                    "--no-enable-prefix-caching", "--enforce-eager"))
    server.command = [str(vllm_python()), "-m", "telemetry", "run", "--targets", f"{TARGET},vllm-sparse-indexer",
                      "--port", str(hook_port), "--log-dir", str(log_dir),
                      "--unresolved-after", str(UNRESOLVED_AFTER_S), "--", *server.command]
    return SharedVllm("vllm_under_run", server, directory, hook_port, log_dir)


LAUNCHES: dict[str, Callable[[Path, Path], SharedVllm]] = {
    "vllm_counting": _counting, "vllm_indexer": _indexer, "vllm_under_run": _under_run}


class SharedServers:
    """The session's launches: which selected tests use each, which are running."""

    def __init__(self, items: Iterable[pytest.Item], directory: Path, model: Path) -> None:
        self.directory = directory
        self.model = model
        self.users: dict[str, set[str]] = {name: set() for name in LAUNCHES}
        self.unmarked: list[str] = []
        for item in items:
            names = set(getattr(item, "fixturenames", ())) & set(LAUNCHES)
            for name in names:
                self.users[name].add(item.nodeid)
            if names and item.get_closest_marker("vllm") is None:
                self.unmarked.append(item.nodeid)
        self.running: dict[str, SharedVllm] = {}

    def get(self, name: str) -> SharedVllm:
        if self.unmarked:
            pytest.fail(f"these tests use a real vLLM server but are not marked vllm: {', '.join(self.unmarked)}")
        for launch, users in self.users.items():   # every launch a selected test still needs, started together
            if (users or launch == name) and launch not in self.running:
                directory = self.directory / launch
                directory.mkdir()
                shared = LAUNCHES[launch](directory, self.model)
                self.running[launch] = shared
                shared.start()
        return self.running[name].ready()

    def finished(self, nodeid: str) -> None:
        """A test's teardown is over: stop each launch it was the last user of (then its after-stop checks)."""
        for launch, users in self.users.items():
            if nodeid in users:
                users.discard(nodeid)
                if not users and launch in self.running:
                    self.running[launch].stop()

    def close(self) -> None:
        for shared in self.running.values():
            shared.stop(run_checks=False)


_SESSION: list[SharedServers] = []   # the running session's servers, for teardown_done


def open_session(items: Iterable[pytest.Item], directory: Path, model: Path) -> SharedServers:
    servers = SharedServers(items, directory, model)
    _SESSION.append(servers)
    return servers


def close_session(servers: SharedServers) -> None:
    try:
        servers.close()
    finally:
        _SESSION.remove(servers)


def teardown_done(nodeid: str) -> None:
    for servers in _SESSION:
        servers.finished(nodeid)
