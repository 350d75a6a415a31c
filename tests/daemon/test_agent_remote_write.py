"""Off the box: the shipped Prometheus agent config (configs/prometheus/agent.yml) ships a real daemon's
samples to a second Prometheus over remote write.

Two of Debian's Prometheus processes: an agent (`--enable-feature=agent`) running the shipped config with
only its targets and remote-write URL changed, scraping a real `memtel daemon` that follows the real
/dev/kmsg, and a receiver started with `--web.enable-remote-write-receiver`. A kernel NV_ERR_NO_MEMORY line
written into /dev/kmsg (marked as a test line, counted by this test's daemon only) must show up in the
receiver's query API. Everything listens on 127.0.0.1 on free ports; the line's text is unique to this run.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import yaml

from tests.daemon.helpers import ROOT, Daemon, wait_for
from tests.support.kmsg import DAEMON_COUNTS_TEST_LINES, write_kmsg
from tests.support.ports import free_port

AGENT_CONFIG = ROOT / "configs" / "prometheus" / "agent.yml"


def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    assert binary, "the `prometheus` binary is missing: apt-get install -y prometheus (scripts/test does it)"
    return binary


class Prometheus:
    """One Prometheus process in its own process group; stopped (TERM, then KILL) by the context manager."""

    def __init__(self, tmp: Path, name: str, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"{name}.log"
        self.args = [prometheus_binary(), f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn", *args]
        self.proc: subprocess.Popen | None = None

    def start(self) -> Prometheus:
        """Start it without waiting (wait_ready waits)."""
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_ready(self) -> None:
        wait_for(self.ready, timeout=60, interval=0.1, what=f"{self.args[1]} ready")

    def __enter__(self) -> Prometheus:
        if self.proc is None:
            self.start()
        self.wait_ready()
        return self

    def ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n{self.log()}")
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, expr: str) -> list[dict]:
        body = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=5).json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def agent_config(daemon_target: str, receiver: str, node: str) -> dict:
    """The shipped agent config with only its targets, node label and remote-write URL changed."""
    config = yaml.safe_load(AGENT_CONFIG.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["memtel-daemon"]["static_configs"] = [{"targets": [daemon_target], "labels": {"node": node}}]
    # No hook runs here: its job points at a free port (its `up` is 0; nothing else changes).
    jobs["memtel-hook"]["static_configs"] = [{"targets": [f"127.0.0.1:{free_port()}"], "labels": {"node": node}}]
    assert len(config["remote_write"]) == 1
    config["remote_write"][0]["url"] = f"{receiver}/api/v1/write"
    return config


@pytest.mark.prometheus
def test_the_shipped_agent_config_is_valid():
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: apt-get install -y prometheus"
    result = subprocess.run([promtool, "check", "config", "--agent", str(AGENT_CONFIG)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load(AGENT_CONFIG.read_text())
    assert config["global"]["scrape_interval"] == "1s"
    assert config["remote_write"][0]["queue_config"]["batch_send_deadline"] == "1s"
    assert {job["job_name"] for job in config["scrape_configs"]} == {"memtel-daemon", "memtel-hook"}


@pytest.mark.prometheus
@pytest.mark.kmsg
def test_a_kernel_line_reaches_a_second_prometheus_through_the_agent(tmp_path):
    token = uuid.uuid4().hex[:12]
    pattern = f"agent_{token}"
    node = f"agent-test-{token}"
    daemon = Daemon(tmp_path / "state", "--kmsg-pattern", f"{pattern}={token}", *DAEMON_COUNTS_TEST_LINES,
                    "--disable-collector", "nvml", "--disable-collector", "processes", "--no-flight-recorder")
    receiver_config = tmp_path / "receiver.yml"
    receiver_config.write_text("global:\n  scrape_interval: 15s\n")
    receiver = Prometheus(tmp_path, "receiver", f"--config.file={receiver_config}",
                          f"--storage.tsdb.path={tmp_path / 'receiver-tsdb'}", "--web.enable-remote-write-receiver")
    config = tmp_path / "agent.yml"
    config.write_text(yaml.safe_dump(agent_config(f"127.0.0.1:{daemon.port}", receiver.url, node)))
    agent = Prometheus(tmp_path, "agent", "--enable-feature=agent", f"--config.file={config}",
                       f"--storage.agent.path={tmp_path / 'agent-wal'}")
    # The three start at once, then each is waited for (the agent retries what it cannot send yet).
    with ExitStack() as running:
        running.callback(daemon.stop)
        daemon.start(wait=False)
        running.callback(receiver.stop)
        receiver.start()
        running.callback(agent.stop)
        agent.start()
        daemon.wait_ready()
        receiver.wait_ready()
        agent.wait_ready()
        selector = f'{{pattern="{pattern}",node="{node}",job="memtel-daemon",agent="memtel"}}'
        wait_for(lambda: receiver.query(f"memtel_kernel_pattern_matches_total{selector}"), timeout=60,
                 interval=0.2, what=f"the daemon's series in the receiver\n{agent.log()}")
        assert float(receiver.query(f"memtel_kernel_pattern_matches_total{selector}")[0]["value"][1]) == 0
        nv_err_before = receiver.query(f'memtel_kernel_nv_err_no_memory_total{{node="{node}"}}')
        assert nv_err_before, "the NV_ERR counter is exported from the start"

        written = time.monotonic()
        write_kmsg(f"NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] {token}")
        wait_for(lambda: float(receiver.query(f"memtel_kernel_pattern_matches_total{selector}")[0]["value"][1])
                 == 1, timeout=30, interval=0.1, what="the kernel line in the receiver")
        seconds = time.monotonic() - written
        nv_err = receiver.query(f'memtel_kernel_nv_err_no_memory_total{{node="{node}"}}')
        assert float(nv_err[0]["value"][1]) >= float(nv_err_before[0]["value"][1]) + 1
        up = receiver.query(f'up{{job="memtel-daemon",node="{node}"}}')
        assert float(up[0]["value"][1]) == 1  # the agent's own scrape health travels too
    # 1 s scrape + at most 1 s in the agent's queue + query polling: a few seconds, not the default 5 s+
    assert seconds < 10, f"the line took {seconds:.1f} s to reach the receiver"
    print(f"kernel line -> receiver query API: {seconds:.2f} s")
