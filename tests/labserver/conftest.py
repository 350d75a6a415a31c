"""A real `memtel lab serve` process per test (module), on free loopback ports, always stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.ports import free_port, free_port_block

ROOT = Path(__file__).resolve().parents[2]

# Small shapes: 4 layers, 1,024-token chunks, a 4 MiB budget (stock splits its launches from 4k tokens on).
SMALL = ["--layers", "4", "--chunk", "1024", "--max-model-len", "16384", "--budget-mb", "4", "--scale", "1",
         "--time-scale", "0"]


class LabServer:
    def __init__(self, tmp: Path, *args: str, ranks: int = 2, arm: str = "stock", env: dict | None = None) -> None:
        self.port = free_port()
        self.rank_port = free_port_block(ranks)
        self.ranks = ranks
        self.log_dir = tmp / f"hook-{arm}-{self.port}"
        self.log_path = tmp / f"lab-{arm}-{self.port}.log"
        self.command = [sys.executable, "-m", "telemetry", "lab", "serve", "--arm", arm, "--ranks", str(ranks),
                        "--allocator", "sim", "--port", str(self.port), "--memtel-port", str(self.rank_port),
                        "--memtel-log-dir", str(self.log_dir), *args]
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> subprocess.Popen:
        """The server's process (after start)."""
        assert self.process is not None, "the lab server was not started"
        return self.process

    def rank_url(self, rank: int) -> str:
        return f"http://127.0.0.1:{self.rank_port + rank}/metrics"

    def start(self, timeout: float = 60.0) -> LabServer:
        self.launch()
        return self.wait_ready(timeout)

    def launch(self) -> None:
        """Start the process (wait_ready waits for its health): several servers can start at once."""
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                            env=self.env, start_new_session=True, stdin=subprocess.DEVNULL)

    def wait_ready(self, timeout: float = 60.0) -> LabServer:
        import httpx  # the harness extra: test modules that need it skip without it (tests/support/extras.py)

        assert self.process is not None, "the lab server was not launched"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"lab server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"lab server not healthy in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # the ranks share the group: none may remain
        except ProcessLookupError:
            pass
        self.process.wait()

    def __enter__(self) -> LabServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def started(*servers: LabServer) -> Iterator[tuple[LabServer, ...]]:
    """Start every server at once (a start is mostly imports in three processes: on two cores, several
    overlap), wait until each is healthy; stop them all at the end."""
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="session")
def lab_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    """One SMALL server for every test that only sends it requests (test_api, test_prefix_cache: their prompts
    use their own words, and they read counters as differences)."""
    with LabServer(tmp_path_factory.mktemp("lab"), *SMALL) as server:
        yield server
