"""The live stack of test_live_prometheus.py: node daemon, hook process and Prometheus, all real.

Everything listens on 127.0.0.1 on free ports; every process runs in its own process group and
is stopped (TERM, then KILL) when the stack closes. Prometheus gets the shipped
configs/prometheus/prometheus.yml with its jobs, relabelling and rule files, and only the targets,
intervals and paths changed: scrape and evaluation every second, the daemon as a static target,
the hook exporter through a file_sd targets file (the fleet path).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from tests.dashboards.promql import ROOT, RULE_FILES
from tests.support.ports import free_port

SHIPPED_CONFIG = ROOT / "configs" / "prometheus" / "prometheus.yml"
HOOK_MARKER = "memtel-live-hook-process"
KMSG = "/dev/kmsg"


def need_prometheus() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("the `prometheus` binary is missing: install Debian's prometheus package "
                           "(scripts/test does: `source scripts/lib/setup.sh && ensure_system_packages`, as root)")
    return binary


def write_kmsg(line: str) -> None:
    """Append one record to the kernel log, as a driver would; needs root (CAP_SYSLOG)."""
    try:
        fd = os.open(KMSG, os.O_WRONLY)
    except PermissionError as exc:
        raise RuntimeError(f"cannot write {KMSG}: {exc.strerror}; the kmsg tests need root") from exc
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def wait_until(what: str, check: Callable[[], object], timeout: float, interval: float = 0.5):
    """Poll `check` until it returns a truthy value; raise TimeoutError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = check()
            if value:
                return value
        except (httpx.HTTPError, OSError, ValueError) as exc:
            last_error = exc
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s" + (f" (last error: {last_error})" if last_error else ""))
        time.sleep(interval)


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log_path: Path

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def check_running(self) -> None:
        if self.popen.poll() is not None:
            raise RuntimeError(f"{self.name} exited with status {self.popen.returncode}:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=10)


def start(name: str, argv: list[str], log_dir: Path, env: dict | None = None) -> Process:
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log_file:
        popen = subprocess.Popen(argv, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    return Process(name, popen, log_path)


def prometheus_config(daemon_target: str, hook_targets_file: Path, node: str) -> dict:
    """The shipped config with test targets, 1 s intervals and absolute rule file paths."""
    config = yaml.safe_load(SHIPPED_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["rule_files"] = [str(path) for path in RULE_FILES]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    daemon, hook_fleet = jobs["memtel-daemon"], jobs["memtel-hook-fleet"]
    daemon["static_configs"] = [{"targets": [daemon_target], "labels": {"node": node}}]
    hook_fleet["file_sd_configs"] = [{"files": [str(hook_targets_file)], "refresh_interval": "1s"}]
    config["scrape_configs"] = [daemon, hook_fleet]
    return config


@dataclass
class LiveStack:
    tmp: Path
    node: str = field(default_factory=socket.gethostname)
    processes: list = field(default_factory=list)
    prometheus_url: str = ""
    daemon_port: int = 0
    hook_port: int = 0
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=10.0))

    def start(self) -> LiveStack:
        prometheus = need_prometheus()
        # The hook process is rank 0 of its own; no MEMTEL_* setting of the caller leaks into it.
        env = {k: v for k, v in os.environ.items() if not k.startswith("MEMTEL_")}
        env.update(PYTHONPATH=str(ROOT), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        self.daemon_port, self.hook_port = free_port(), free_port()

        daemon_config = self.tmp / "daemon.yaml"
        daemon_config.write_text(yaml.safe_dump({"processes": {"roles": [{"role": "worker", "cmdline": HOOK_MARKER}]}}))
        self.daemon = start("daemon", [sys.executable, "-m", "telemetry", "daemon", "--config", str(daemon_config),
                                       "--listen", f"127.0.0.1:{self.daemon_port}",
                                       "--state-dir", str(self.tmp / "daemon-state")], self.tmp, env)
        self.processes.append(self.daemon)
        self.hook = start("hook", [sys.executable, "-m", "tests.dashboards.live_hook_process",
                                   "--port", str(self.hook_port), "--seconds", "600", "--marker", HOOK_MARKER],
                          self.tmp, env)
        self.processes.append(self.hook)
        for process, port in ((self.daemon, self.daemon_port), (self.hook, self.hook_port)):
            wait_until(f"{process.name} /metrics on 127.0.0.1:{port}",
                       lambda p=process, port=port: p.check_running() or self._metrics_up(port), timeout=60)

        hook_targets = self.tmp / "targets" / "hook-live.yml"
        hook_targets.parent.mkdir()
        hook_targets.write_text(yaml.safe_dump([{"targets": [f"127.0.0.1:{self.hook_port}"],
                                                 "labels": {"node": self.node}}]))
        config_path = self.tmp / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(prometheus_config(f"127.0.0.1:{self.daemon_port}", hook_targets,
                                                                self.node), sort_keys=False))
        port = free_port()
        self.prometheus_url = f"http://127.0.0.1:{port}"
        self.prometheus = start("prometheus", [prometheus, f"--config.file={config_path}",
                                               f"--storage.tsdb.path={self.tmp / 'tsdb'}",
                                               f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                self.tmp)
        self.processes.append(self.prometheus)
        wait_until("Prometheus ready", lambda: self.prometheus.check_running() or
                   self.client.get(f"{self.prometheus_url}/-/ready").status_code == 200, timeout=60)
        return self

    def _metrics_up(self, port: int) -> bool:
        return self.client.get(f"http://127.0.0.1:{port}/metrics").status_code == 200

    def check_running(self) -> None:
        for process in self.processes:
            process.check_running()

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        self.client.close()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.log_tail()}" for p in self.processes)

    # Prometheus HTTP API
    def api(self, path: str, **params) -> object:
        response = self.client.get(f"{self.prometheus_url}/api/v1/{path}", params=params)
        body = response.json()
        if body.get("status") != "success":
            raise ValueError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query; the result's series (an empty list when there are none)."""
        data = self.api("query", query=expr)
        if data["resultType"] != "vector":
            return [{"metric": {}, "value": data["result"]}]  # a scalar or string is one "series"
        return data["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        return self.api(f"label/{label}/values", **{"match[]": match})

    def alerts(self, name: str | None = None) -> list[dict]:
        alerts = self.api("alerts")["alerts"]
        return [a for a in alerts if name is None or a["labels"].get("alertname") == name]

    def targets_up(self) -> dict[str, str]:
        return {t["labels"]["job"]: t["health"] for t in self.api("targets")["activeTargets"]}
