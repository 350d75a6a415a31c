"""The life of one arm's server within a run: started (for a served arm) with its environment and log
inside the run directory, recorded (serve_start, serve_ready, server_info, serve_stop), checked for
life, and stopped for sure, even on a second Ctrl-C.

The process itself (its own process group, the watchdog, SIGTERM then SIGKILL) is harness/ab/serve.py;
this module is what the run knows about it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from harness.ab.config import Arm
from harness.ab.records import RecordWriter, ServeReady, ServerInfo, ServeStart, ServeStop
from harness.ab.redact import Redactor, redact_argv, redact_env
from harness.ab.rundir import inside_run_dir
from harness.ab.serve import ServedProcess
from harness.ab.status import Status
from telemetry import hook_env
from telemetry.engines.registry import HEALTH_PATH, MODELS_PATH


def expand(value: str, fields: dict[str, str]) -> str:
    """`{run_dir}`, `{arm}` and `{repeat}` in a serve command's env and log_file, filled in."""
    for key, replacement in fields.items():
        value = value.replace("{" + key + "}", replacement)
    return value


def relative_to_run(out_dir: Path, path: Path) -> str:
    """Paths inside the run directory are recorded relative to it, so the directory can move."""
    try:
        return str(path.resolve().relative_to(out_dir.resolve()))
    except ValueError:
        return str(path)


def max_model_len(models: object, model: str) -> int | None:
    """max_model_len of the served model from /v1/models (data[i].max_model_len: vLLM's shape, which SGLang and
    the lab server answer too; telemetry/engines)."""
    if not isinstance(models, dict) or not isinstance(models.get("data"), list):
        return None
    cards = [c for c in models["data"] if isinstance(c, dict)]
    card = next((c for c in cards if c.get("id") == model), cards[0] if cards else None)
    value = card.get("max_model_len") if card else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class ArmServer:
    """The server of the block running now: the one the run started (served arm) or the arm's URL."""

    def __init__(self, out_dir: Path, writer: RecordWriter, http: httpx.Client, status: Status,
                 redactor: Redactor, log: Callable[[str], None], *, model: str, child_umask: int = -1) -> None:
        self.out_dir = out_dir
        self.writer = writer
        self.http = http
        self.status = status
        self.redactor = redactor
        self.log = log
        self.model = model
        self.child_umask = child_umask  # the served commands keep the user's umask
        self.process: ServedProcess | None = None

    def start(self, arm: Arm, repeat: int) -> None:
        """Start a served arm's command, record it, and wait until it is healthy (ServeError if not)."""
        spec = arm.serve
        assert spec is not None
        fields = {"run_dir": str(self.out_dir.resolve()), "arm": arm.name, "repeat": str(repeat)}
        env = {k: expand(v, fields) for k, v in spec.env.items()}
        extra_env = {}
        targets = env.get(hook_env.TARGETS) or (os.environ.get(hook_env.TARGETS) if spec.inherit_env else None)
        if targets and hook_env.LOG_DIR not in env:
            extra_env[hook_env.LOG_DIR] = str(self.out_dir.resolve() / "hook-logs" / f"{arm.name}-r{repeat}")
        hook_log_dir = env.get(hook_env.LOG_DIR) or extra_env.get(hook_env.LOG_DIR)
        if hook_log_dir:
            Path(hook_log_dir).mkdir(parents=True, exist_ok=True)
        spec = dataclasses.replace(spec, env=env)
        log_name = expand(spec.log_file, fields) if spec.log_file else f"logs/{arm.name}-r{repeat}-serve.log"
        log_path = inside_run_dir(self.out_dir, log_name, what=f"arms {arm.name}: serve.log_file")
        self.status.phase = "starting server"
        shown = self.redactor.value(redact_argv(spec.command))
        server = ServedProcess(spec, log_path, extra_env=extra_env, shown_command=shown, umask=self.child_umask)
        server.start()
        self.process = server
        assert server.pid is not None
        self.writer.write(ServeStart(arm=arm.name, repeat=repeat, command=shown,
                                     env=redact_env({**extra_env, **spec.env}),  # expanded, and what was added
                                     cwd=spec.cwd, pid=server.pid, pgid=server.pid,
                                     log=relative_to_run(self.out_dir, log_path),
                                     hook_log_dir=relative_to_run(self.out_dir, Path(hook_log_dir)) if hook_log_dir
                                     else None,
                                     start_time_ticks=server.info.start_time_ticks if server.info else None,
                                     boot_id=server.boot_id))
        seconds = server.wait_healthy()
        self.writer.write(ServeReady(arm=arm.name, repeat=repeat, pgid=server.pid, startup_s=seconds))
        self.log(f"[{arm.name} repeat {repeat}] server ready in {seconds:.1f} s (pid {server.pid})")

    def stop(self) -> None:
        """Stop the server the run started, if any, and record how it went."""
        server, self.process = self.process, None
        if server is None or server.process is None:
            return
        self.status.phase = "stopping server"
        # A second Ctrl-C must not cut the stop short and leave the server behind.
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            how = server.stop()
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        self.writer.write(ServeStop(pgid=server.pid, how=how, exit_code=server.process.returncode))

    def alive(self, arm: Arm) -> bool:
        """The server can take the next request: a served arm's process is running and its health URL answers
        200; an external arm's /health answers 200. The process alone is not enough: a request can fail on a
        server that was killed a moment before its leader is gone, and a server whose engine died can outlive it."""
        if self.process is not None:
            if not self.process.alive():
                return False
            health_url = self.process.spec.health_url
        else:
            health_url = arm.url + HEALTH_PATH
        try:
            return self.http.get(health_url, timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def info(self, arm: Arm, repeat: int, ranks: dict[str, str]) -> int | None:
        """Record the server's /version, /v1/models and which rank exporters answer; its max_model_len."""
        info: dict[str, Any] = {}
        for key, path in (("version", "/version"), ("models", MODELS_PATH)):
            try:
                response = self.http.get(arm.url + path, timeout=10.0)
                info[key] = response.json() if response.status_code == 200 else f"HTTP {response.status_code}"
            except (httpx.HTTPError, ValueError) as exc:
                info[key] = f"unavailable: {type(exc).__name__}"
        rank_errors = {}
        for name, url in ranks.items():
            try:
                self.http.get(url, timeout=5.0).raise_for_status()
            except httpx.HTTPError as exc:
                rank_errors[name] = f"{url}: {type(exc).__name__}: {exc}"
        self.writer.write(ServerInfo(arm=arm.name, repeat=repeat, url=arm.url, version=info["version"],
                                     models=info["models"], rank_errors=rank_errors))
        for name, error in rank_errors.items():
            self.log(f"[{arm.name} repeat {repeat}] warning: rank {name} not reachable ({error})")
        return max_model_len(info["models"], self.model)


__all__ = ["ArmServer", "expand", "max_model_len", "relative_to_run"]
