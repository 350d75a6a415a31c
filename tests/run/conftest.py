"""Running programs under `memtel run` for the tests: the environment, the command, and reading what came out.

Each test gets its own runtime directory (XDG_RUNTIME_DIR in tmp_path, so its run directories are its own),
the test programs of tests/run/programs on PYTHONPATH, this venv's bin first on PATH (so `python` is a
Python with memtel and torch) and no MEMTEL_* variable from outside. `memtel run` is started as
`python -m telemetry run`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.support.http import get_text

PROGRAMS = Path(__file__).resolve().parent / "programs"
ANNOUNCEMENT = "memtel hook on in pid "


@pytest.fixture
def run_env(tmp_path: Path) -> dict[str, str]:
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMTEL_", "PYTHONPATH"))}
    env.update({"PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", os.defpath)]),
                "PYTHONPATH": str(PROGRAMS), "XDG_RUNTIME_DIR": str(runtime), "MEMTEL_ADDR": "127.0.0.1",
                "PYTHONUNBUFFERED": "1"})
    return env


def memtel_run_command(*options: str) -> list[str]:
    return [sys.executable, "-m", "telemetry", "run", *options]


def memtel_run(options: list[str], command: list[str], env: dict[str, str], *, timeout: float = 240,
               cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*memtel_run_command(*options), "--", *command], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def announcements(stderr: str) -> dict[int, str]:
    """pid -> the hook's one announcement line of that process."""
    found: dict[int, str] = {}
    for line in stderr.splitlines():
        if ANNOUNCEMENT in line:
            pid = int(line.split(ANNOUNCEMENT, 1)[1].split(":", 1)[0])
            assert pid not in found, f"two announcements in pid {pid}:\n{stderr}"
            found[pid] = line
    return found


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def logs_by_pid(log_dir: Path) -> dict[int, tuple[Path, list[dict]]]:
    return {int(path.name.rsplit("-pid", 1)[1].split(".")[0]): (path, read_log(path))
            for path in sorted(log_dir.glob("memtel-calls-rank*-pid*.jsonl"))}


def scrape(port: int) -> dict[str, float]:
    samples = {}
    for line in get_text(f"http://127.0.0.1:{port}/metrics", timeout=5).splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def listeners(ports: range) -> dict[int, int]:
    """port -> pid of the process listening on it."""
    return {c.laddr.port: c.pid for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port in ports}


@dataclass
class Handshake:
    """The ready/go files of tests/run/programs/handshake.py."""

    directory: Path

    def wait_ready(self, count: int, process: subprocess.Popen, timeout: float = 180) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready = sorted(self.directory.glob("ready-*.json"))
            if len(ready) >= count:
                return [json.loads(path.read_text()) for path in ready]
            if process.poll() is not None:
                raise AssertionError(f"the program exited ({process.returncode}) before {count} workers were ready")
            time.sleep(0.1)
        raise AssertionError(f"{count} workers not ready after {timeout} s: {list(self.directory.iterdir())}")

    def go(self) -> None:
        (self.directory / "go").touch()


@pytest.fixture
def handshake(tmp_path: Path) -> Handshake:
    directory = tmp_path / "handshake"
    directory.mkdir()
    return Handshake(directory)
