"""Helpers for A/B runs against the lab server (`memtel lab serve`, simulator allocator): served arms, the
harness as a child process, records read back, bounded waits, and the real node daemon."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx

from tests.support.ports import free_port, free_port_block

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def lab_arm(name: str, mode: str, *, max_model_len: int = 65536, chunk: int = 1024, layers: int = 2,
            budget_mb: str = "64", scale: str = "0.25", time_scale: str = "0", ranks: int = 1,
            extra: tuple[str, ...] = ()) -> dict:
    """A served lab arm with the hook on (its exporter on a free port, its call log under the run directory)."""
    port = free_port_block(1 + ranks)   # one block: two free_port() calls can return the same port
    hook = port + 1
    command = [sys.executable, "-m", "telemetry", "lab", "serve", "--arm", mode, "--port", str(port),
               "--host", "127.0.0.1", "--model-name", "lab", "--allocator", "sim", "--ranks", str(ranks),
               "--max-model-len", str(max_model_len), "--chunk", str(chunk), "--layers", str(layers),
               "--budget-mb", budget_mb, "--scale", scale, "--time-scale", time_scale, "--memtel-port", str(hook),
               *extra]
    env = {"MEMTEL_LOG_DIR": "{run_dir}/hook-logs/{arm}-r{repeat}"}
    return {"name": name, "serve": {"command": command, "env": env, "health_url": f"http://127.0.0.1:{port}/health",
                                    "startup_timeout_s": 120, "stop_grace_s": 15, "cwd": str(ROOT)},
            "ranks": {f"rank{r}": f"http://127.0.0.1:{hook + r}/metrics" for r in range(ranks)}}


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a suite started in the background runs with SIGINT ignored


def harness(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "telemetry", "ab", *args], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_sigint_default)


def run_ab(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "telemetry", "ab", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def run_ab_together(runs: list[list[str]], timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """Several `memtel ab ARGS` at once (independent runs: their own arms, ports and run directories), each as
    run_ab returns it. A run is mostly one busy process at a time (the harness or its server), so on two cores
    two runs take little longer than one."""
    with contextlib.ExitStack() as files:
        outputs = [(files.enter_context(tempfile.TemporaryFile()), files.enter_context(tempfile.TemporaryFile()))
                   for _ in runs]  # files, not pipes: a run never waits for its output to be read
        procs = [subprocess.Popen([sys.executable, "-m", "telemetry", "ab", *args], cwd=ROOT, stdout=out,
                                  stderr=err, stdin=subprocess.DEVNULL)
                 for args, (out, err) in zip(runs, outputs, strict=True)]
        try:
            deadline = time.monotonic() + timeout
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        results = []
        for proc, (out, err) in zip(procs, outputs, strict=True):
            out.seek(0)
            err.seek(0)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out.read().decode(errors="replace"),
                                                       err.read().decode(errors="replace")))
        return results


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "results.jsonl"
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def events(run_dir: Path, kind: str, **match: Any) -> list[dict[str, Any]]:
    return [r for r in records(run_dir) if r["event"] == kind and all(r.get(k) == v for k, v in match.items())]


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def wait_for(predicate: Callable[[], T], timeout: float, what: str, proc: subprocess.Popen[Any] | None = None,
             log: Path | None = None) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"harness exited ({proc.returncode}) while waiting for {what}:\n"
                                 f"{tail(log) if log else ''}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}:\n{tail(log) if log else ''}")


@contextlib.contextmanager
def node_daemon(state_dir: Path) -> Iterator[str]:
    """The real memtel node daemon on a free loopback port; yields its /metrics URL."""
    state_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = state_dir / "daemon.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "telemetry", "daemon", "--listen", f"127.0.0.1:{port}",
                                 "--state-dir", str(state_dir / "state")], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/metrics"

    def up() -> bool:
        try:
            return httpx.get(url, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, 60, "the node daemon", proc, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
