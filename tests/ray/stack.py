"""The live Ray fleet of tests/ray and benchmarks/ray_router_bench.py: four lab engines and one local Ray cluster.

Four lab nodes of 1.5 GiB (harness/demo/guarded.py's: one rank, the hook's live forecast on; about 401k tokens fit at
rest) start from this venv; tests/ray/app.py starts from .venv-ray a local Ray cluster with two Serve applications,
`memtel` (memtel's request router) and `default` (Ray's own), each of two replicas proxying to two of the nodes.
Every process is stopped on the way out (the app stops Serve and Ray on SIGTERM).
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from harness.demo.guarded import FORECAST_ENV, NODE_ARGS, Process, prompt_text
from harness.ports import free_port_block
from harness.processes import wait_healthy
from telemetry.catalogue.vllm import PROMPT_TOKENS
from telemetry.errors import RunError
from telemetry.scrape.reader import parse

ROOT = Path(__file__).resolve().parents[2]
RAY_PYTHON = ROOT / ".venv-ray" / "bin" / "python"
APPS = ("memtel", "default")
CAPACITY_GB = 1.5
START_TIMEOUT_S = 180.0


class RayStack:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        base = free_port_block(9)
        self.port = base
        # Per application, its two engines: (port, hook port).
        self.engines = {app: [(base + 1 + 4 * i + 2 * j, base + 2 + 4 * i + 2 * j) for j in range(2)]
                        for i, app in enumerate(APPS)}
        self.nodes: dict[tuple[str, int], Process] = {}
        self.app: Process | None = None
        self.start_s: float | None = None

    def url(self, app: str) -> str:
        return f"http://127.0.0.1:{self.port}/{app}/v1"

    def engine_url(self, app: str, index: int) -> str:
        return f"http://127.0.0.1:{self.engines[app][index][0]}"

    def node_log(self, app: str, index: int) -> Path:
        return self.tmp / f"{app}-{index}.log"

    def start(self) -> None:
        started = time.monotonic()
        for app, engines in self.engines.items():
            for index in range(len(engines)):
                self.nodes[(app, index)] = self._node(app, index)
        pairs = {app: ",".join(f"http://127.0.0.1:{p}=http://127.0.0.1:{h}/metrics" for p, h in engines)
                 for app, engines in self.engines.items()}
        self.app = Process([str(RAY_PYTHON), str(ROOT / "tests" / "ray" / "app.py"), "--port", str(self.port),
                            "--slots", str(self.tmp), "--memtel", pairs["memtel"], "--default", pairs["default"]],
                           self.tmp / "app.log", {"PYTHONPATH": str(ROOT)})
        for app, index in self.nodes:
            self._healthy(app, index)
        deadline = started + START_TIMEOUT_S
        while not (self.tmp / "ready").exists():
            if not self.app.alive() or time.monotonic() > deadline:
                raise RunError(f"the Ray app did not start; {self.tmp / 'app.log'}:\n"
                               f"{(self.tmp / 'app.log').read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)
        for app in APPS:  # each application answers, through a replica, before the first test
            self.wait(functools.partial(_answers, f"{self.url(app)}/models"), f"the {app} application")
        self.start_s = time.monotonic() - started

    def _node(self, app: str, index: int) -> Process:
        port, hook = self.engines[app][index]
        command = [sys.executable, "-m", "telemetry", "lab", "serve", *NODE_ARGS, "--capacity-gb", repr(CAPACITY_GB),
                   "--time-scale", "0.01", "--host", "127.0.0.1", "--port", str(port), "--memtel-port", str(hook),
                   "--model-name", "lab"]
        return Process(command, self.node_log(app, index), FORECAST_ENV)

    def _healthy(self, app: str, index: int) -> None:
        wait_healthy(f"{self.engine_url(app, index)}/health", self.nodes[(app, index)].process,
                     timeout_s=START_TIMEOUT_S, log_path=self.node_log(app, index), what=f"lab node {app}-{index}",
                     error=RunError, interval_s=0.1)

    def restart(self, app: str, index: int) -> None:
        """A fresh engine on the same ports (an engine keeps the memory its prefills cached: a tenant then takes
        only what is left, and the engine can still take as long a prompt from its cache)."""
        self.nodes[(app, index)].stop(grace_s=5.0)
        self.nodes[(app, index)] = self._node(app, index)
        self._healthy(app, index)

    def wait(self, condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise RunError(f"waited {timeout_s:.0f} s for {what}")
            time.sleep(0.05)

    def prompt_tokens(self, app: str, index: int) -> float:
        """The engine's vllm:prompt_tokens_total: the prompt tokens it has prefilled."""
        return parse(httpx.get(f"{self.engine_url(app, index)}/metrics", timeout=5).text).total(PROMPT_TOKENS) or 0.0

    def tenant(self, app: str, index: int, gib: float) -> None:
        """Another process on that engine's node holds `gib` GiB from now (0: gives them back)."""
        httpx.post(f"{self.engine_url(app, index)}/lab/tenant", json={"gib": gib}, timeout=10).raise_for_status()

    def oom_lines(self, app: str, index: int) -> list[str]:
        text = self.node_log(app, index).read_text(errors="replace")
        return [line for line in text.splitlines() if "out of memory" in line]

    def stop(self) -> None:
        if self.app is not None:
            # SIGTERM to the app alone first: it stops Ray, whose processes share its process group (a signal to
            # the group would take Ray's own processes down under it and its shutdown would wait for them).
            if self.app.alive():
                os.kill(self.app.process.pid, signal.SIGTERM)
                try:
                    self.app.process.wait(20)
                except subprocess.TimeoutExpired:
                    pass
            self.app.stop(grace_s=5.0)
        for node in self.nodes.values():
            node.stop()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def burst(base_url: str, words: int, count: int, seed: int, timeout_s: float = 120.0) -> list[tuple[str, str, float]]:
    """`count` prompts of `words` words at once through the OpenAI client (no retries): (outcome, served by or the
    error, seconds) each; outcome "ok" or the exception's class name."""
    import openai

    found: list[tuple[str, str, float]] = [("not_run", "", 0.0)] * count

    def send(i: int) -> None:
        started = time.perf_counter()
        with openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=timeout_s) as client:
            try:
                answer = client.completions.with_raw_response.create(model="lab", prompt=prompt_text(words, seed + i),
                                                                     max_tokens=4)
                found[i] = ("ok", answer.headers.get("x-served-by", ""), time.perf_counter() - started)
            except openai.APIError as exc:
                found[i] = (type(exc).__name__, str(exc)[:300], time.perf_counter() - started)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 10)
    return found


__all__ = ["APPS", "RAY_PYTHON", "RayStack", "burst"]
