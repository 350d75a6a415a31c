"""Live stacks for the dashboard tests: real daemons, hook processes, lab servers, Prometheus, Alertmanager.

`TwoNodeStack` is a DGX Spark pair on one machine, addressed by IP: two "nodes" on the loopback
addresses 127.0.0.2 and 127.0.0.3, each with a real `memtel daemon`, one hook exporter (one rank,
as on a Spark) and a vLLM-shaped `/metrics` (`memtel lab serve`, which serves vLLM 0.32's metric
names), all on the same ports of both addresses, as on real nodes. Prometheus runs the shipped
configs/prometheus/prometheus.yml with its jobs, relabelling, rule files and targets-file layout;
only the rule file paths (absolute), the evaluation interval (1 s) and the Alertmanager address
change. Alertmanager runs the shipped configs/alertmanager/alertmanager.yml with the webhook URL
pointed at a receiver in the test process.

What the nodes see is fixed, so that "no alert at rest" is a property of the configuration and not
of the shared machine the tests run on: each daemon reads a view of /proc whose memory files
(meminfo, vmstat, buddyinfo, pressure) are real captures of this VM (tests/fixtures/proc) and whose
other entries are the real /proc (processes, stat), and follows its own kernel-log file instead of
/dev/kmsg, which the tests append kernel lines to. Nothing is written into the machine's kernel log.

Everything listens on loopback, every process runs in its own process group and is stopped (TERM,
then KILL) when the stack closes.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.dashboards.promql import ROOT, RULE_FILES
from tests.support.ports import free_port
from tests.support.prom import metric

SHIPPED_PROMETHEUS = ROOT / "configs" / "prometheus" / "prometheus.yml"
SHIPPED_ALERTMANAGER = ROOT / "configs" / "alertmanager" / "alertmanager.yml"
FIXTURES = ROOT / "tests" / "fixtures" / "proc"
# Real captures of the CI VM: MemAvailable 23.0 GiB, 6.0 GiB free in blocks of 2 MiB or more.
PROC_FIXTURES = {
    "meminfo": FIXTURES / "meminfo.x86_64-debian12-24g-with-buddyinfo",
    "buddyinfo": FIXTURES / "buddyinfo.x86_64-debian12-24g",
    "vmstat": FIXTURES / "vmstat.x86_64-debian12-24g",
    "pressure/memory": FIXTURES / "pressure-memory.x86_64-debian12-24g",
}
RUNBOOK_BASE = "https://runbooks.example.test/memtel/runbook.md"
# The test stacks' only departures from the shipped timing: every job scraped every second (the shipped hook and
# vLLM jobs: 5 s), and Alertmanager's default group_wait 1 s (shipped: 10 s). Routing, grouping, inhibition and
# the rules are the shipped ones.
TEST_SCRAPE_INTERVAL = "1s"
TEST_GROUP_WAIT = "1s"
GROUP_WAIT_S = 1.0


def need(binary: str, package: str) -> str:
    path = shutil.which(binary)
    if path is None:
        raise RuntimeError(f"the `{binary}` binary is missing: install Debian's {package} package "
                           "(scripts/test does: `source scripts/lib/setup.sh && ensure_system_packages`, as root)")
    return path


def wait_until(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.5) -> Any:
    """Poll `check` until it returns a truthy value; raise TimeoutError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = check()
            if value:
                return value
        except (httpx.HTTPError, OSError, ValueError, KeyError) as exc:
            last_error = exc
        if time.monotonic() >= deadline:
            why = f" (last error: {last_error})" if last_error else ""
            raise TimeoutError(f"{what}: not within {timeout:.0f} s{why}")
        time.sleep(interval)


def free_port_on(hosts: tuple[str, ...], attempts: int = 100) -> int:
    """A port that can be bound now on every one of `hosts` (one port for the same service on each node)."""
    for _ in range(attempts):
        port = free_port(hosts[0])
        try:
            for host in hosts[1:]:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no port free on all of {hosts}")


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

    def running_and(self, ready: Callable[[], Any]) -> Any:
        """`ready()`, after making sure the process still runs (a dead one raises instead of a timeout)."""
        self.check_running()
        return ready()

    def signal(self, signum: int) -> None:
        self.popen.send_signal(signum)

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


def child_env() -> dict[str, str]:
    """The caller's environment without MEMTEL_* settings, with the repository importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMTEL_")}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return env


BOOT_ID = "sys/kernel/random/boot_id"


def proc_view(dest: Path, boot_id: str) -> Path:
    """A /proc for a daemon: the memory files are the real captures in PROC_FIXTURES, the boot id is
    `boot_id` (so a test can "reboot" a node), everything else links to the real /proc."""
    dest.mkdir(parents=True)
    for entry in os.listdir("/proc"):
        if entry not in ("meminfo", "buddyinfo", "vmstat", "pressure", "sys"):
            (dest / entry).symlink_to(Path("/proc") / entry)
    for name, source in PROC_FIXTURES.items():
        target = dest / name
        target.parent.mkdir(exist_ok=True)
        shutil.copyfile(source, target)
    set_boot_id(dest, boot_id)
    return dest


def set_boot_id(proc: Path, boot_id: str) -> None:
    path = proc / BOOT_ID
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(boot_id + "\n")


class KernelLog:
    """A node's kernel log: a file its daemon follows (`--kmsg FILE`), plain text lines as a driver logs them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.touch()

    def write(self, line: str) -> None:
        with open(self.path, "a") as log:
            log.write(line.rstrip("\n") + "\n")


class WebhookReceiver:
    """Alertmanager's webhook receiver: a tiny HTTP server in the test process that keeps every POST body."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                with receiver.lock:
                    receiver.bodies.append(body)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/memtel-alerts"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
        self.thread.start()

    def notifications(self) -> list[dict]:
        with self.lock:
            return list(self.bodies)

    def alerts(self, name: str | None = None, status: str | None = None) -> list[dict]:
        """Every alert of every notification received so far (with its notification's `receiver`)."""
        found = []
        for body in self.notifications():
            for alert in body.get("alerts", []):
                if name is not None and alert["labels"].get("alertname") != name:
                    continue
                if status is None or alert["status"] == status:
                    found.append(dict(alert, receiver=body.get("receiver")))
        return found

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class PrometheusApi:
    def __init__(self, url: str, client: httpx.Client) -> None:
        self.url = url
        self.client = client

    def api(self, path: str, **params: Any) -> Any:
        response = self.client.get(f"{self.url}/api/v1/{path}", params=params)
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

    def alerts_within(self, seconds: float) -> list[dict]:
        """Every alert pending or firing at some rule evaluation of the last `seconds` (from the ALERTS series
        the rule manager writes at each one), as {"labels": ..., "state": ...}."""
        rows = self.query(f"max_over_time(ALERTS[{seconds:.0f}s])")
        return [{"labels": {k: v for k, v in row["metric"].items() if k not in ("__name__", "alertstate")},
                 "state": row["metric"]["alertstate"]} for row in rows]

    def alerts(self, name: str | None = None, states: tuple[str, ...] = ("pending", "firing")) -> list[dict]:
        alerts = self.api("alerts")["alerts"]
        return [a for a in alerts if (name is None or a["labels"].get("alertname") == name) and a["state"] in states]

    def targets(self) -> list[dict]:
        return self.api("targets", state="active")["activeTargets"]

    def rule_groups(self) -> list[dict]:
        return self.api("rules")["groups"]


def prometheus_config(config_dir: Path, rule_files: list[Path], alertmanager: str | None,
                      evaluation_interval: str = "1s", scrape_interval: str | None = TEST_SCRAPE_INTERVAL) -> Path:
    """The shipped prometheus.yml in `config_dir` (whose targets/ the test fills) with absolute rule paths;
    every job scraped every `scrape_interval` (None: the shipped intervals)."""
    config = yaml.safe_load(SHIPPED_PROMETHEUS.read_text())
    config["global"]["evaluation_interval"] = evaluation_interval
    if scrape_interval is not None:
        for job in config["scrape_configs"]:
            job["scrape_interval"] = job["scrape_timeout"] = scrape_interval
    config["global"]["external_labels"]["runbook_base"] = RUNBOOK_BASE
    config["rule_files"] = [str(path) for path in rule_files]
    if alertmanager is None:
        config.pop("alerting", None)
    else:
        config["alerting"]["alertmanagers"][0]["static_configs"] = [{"targets": [alertmanager]}]
    path = config_dir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def start_prometheus(tmp: Path, config_path: Path, client: httpx.Client) -> tuple[Process, PrometheusApi]:
    port = free_port()
    process = start("prometheus", [need("prometheus", "prometheus"), f"--config.file={config_path}",
                                   f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
                                   "--log.level=warn"], tmp)
    api = PrometheusApi(f"http://127.0.0.1:{port}", client)
    wait_until("Prometheus ready", lambda: process.running_and(
        lambda: client.get(f"{api.url}/-/ready").status_code == 200), timeout=60)
    return process, api


def alertmanager_config(webhook_url: str, group_wait: str = TEST_GROUP_WAIT) -> dict:
    """The shipped alertmanager.yml with every webhook pointed at `webhook_url` and the default route's
    group_wait shortened to `group_wait` (the critical route's 0 s stays)."""
    config = yaml.safe_load(SHIPPED_ALERTMANAGER.read_text())
    config["route"]["group_wait"] = group_wait
    for receiver in config["receivers"]:
        for webhook in receiver.get("webhook_configs", []):
            webhook["url"] = webhook_url
    return config


def start_alertmanager(tmp: Path, webhook_url: str, client: httpx.Client) -> tuple[Process, str]:
    config_path = tmp / "alertmanager.yml"
    config_path.write_text(yaml.safe_dump(alertmanager_config(webhook_url), sort_keys=False))
    port = free_port()
    # --cluster.listen-address= (empty): no gossip port on 0.0.0.0:9094, one Alertmanager alone.
    process = start("alertmanager", [need("prometheus-alertmanager", "prometheus-alertmanager"),
                                     f"--config.file={config_path}", f"--storage.path={tmp / 'am-data'}",
                                     f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=",
                                     "--log.level=warn"], tmp)
    url = f"http://127.0.0.1:{port}"
    wait_until("Alertmanager ready", lambda: process.running_and(
        lambda: client.get(f"{url}/-/ready").status_code == 200), timeout=60)
    return process, url


@dataclass
class LiveNode:
    ip: str
    label: str | None   # the `node` label its targets files give; None: derived from the address
    marker: str         # on the hook process's command line, for the daemon's process roles
    previous_boot: bool = False  # its daemon first records a few seconds under another boot id

    @property
    def node(self) -> str:
        """The `node` label its series must carry: the targets file's, else the whole IP."""
        return self.label or self.ip


@dataclass
class TwoNodeStack:
    tmp: Path
    nodes: tuple[LiveNode, ...] = (
        LiveNode("127.0.0.2", "spark-a", "memtel-live-hook-spark-a", previous_boot=True),
        LiveNode("127.0.0.3", None, "memtel-live-hook-node-b"),
    )
    processes: list[Process] = field(default_factory=list)
    kernel_logs: dict[str, KernelLog] = field(default_factory=dict)
    hooks: dict[str, Process] = field(default_factory=dict)
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=10.0))
    webhook: WebhookReceiver | None = None
    alertmanager_url: str = ""
    # What the test saw at rest, before any event (test_live_prometheus.py fills them).
    rest_targets: list[dict] = field(default_factory=list)
    rest_alerts: list[dict] = field(default_factory=list)
    rest_webhook: list[dict] = field(default_factory=list)

    def start(self, extra_targets: dict[str, list[dict]] | None = None) -> TwoNodeStack:
        """Start everything; `extra_targets` are more targets files (name -> groups) for Prometheus to scrape
        besides the nodes' (a file named daemon-*.yml is scraped as the memtel-daemon job)."""
        need("prometheus", "prometheus")
        need("prometheus-alertmanager", "prometheus-alertmanager")
        env = child_env()
        ips = tuple(n.ip for n in self.nodes)
        self.daemon_port, self.hook_port, self.vllm_port = (free_port_on(ips) for _ in range(3))
        for node in self.nodes:
            self._start_node(node, env)
        for node in self.nodes:
            for what, port in (("daemon", self.daemon_port), ("hook", self.hook_port), ("vllm", self.vllm_port)):
                url = f"http://{node.ip}:{port}/metrics"
                wait_until(f"{what} of {node.ip}: {url}", functools.partial(self._serving, url), timeout=90)

        self.webhook = WebhookReceiver()
        am, self.alertmanager_url = start_alertmanager(self.tmp, self.webhook.url, self.client)
        self.processes.append(am)
        config_dir = self.tmp / "prometheus"
        (config_dir / "targets").mkdir(parents=True)
        self._write_targets(config_dir / "targets")
        for name, groups in (extra_targets or {}).items():
            (config_dir / "targets" / name).write_text(yaml.safe_dump(groups))
        config = prometheus_config(config_dir, RULE_FILES, self.alertmanager_url.removeprefix("http://"))
        prometheus, self.prometheus = start_prometheus(self.tmp, config, self.client)
        self.processes.append(prometheus)
        return self

    def _start_node(self, node: LiveNode, env: dict[str, str]) -> None:
        home = self.tmp / node.ip
        home.mkdir()
        self.kernel_logs[node.ip] = KernelLog(home / "kmsg")
        # The hook first: the daemon's /proc view lists the processes alive when it is made.
        hook = start(f"hook-{node.ip}", [sys.executable, "-m", "tests.dashboards.live_hook_process",
                                         "--port", str(self.hook_port), "--addr", node.ip, "--seconds", "900",
                                         "--marker", node.marker, "--log-dir", str(home / "hook-log")],
                     self.tmp, dict(env, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"))
        self.hooks[node.ip] = hook
        self.processes.append(hook)
        vllm = start(f"vllm-{node.ip}", [sys.executable, "-m", "telemetry", "lab", "serve", "--arm", "stock",
                                         "--ranks", "1", "--allocator", "sim", "--no-unified-memory", "--no-hook",
                                         "--host", node.ip, "--port", str(self.vllm_port),
                                         "--model-name", "lab-stock", "--log-level", "WARNING"], self.tmp, env)
        self.processes.append(vllm)
        daemon_config = home / "daemon.yaml"
        daemon_config.write_text(yaml.safe_dump({"processes": {"roles": [{"role": "worker", "cmdline": node.marker}]}}))
        wait_until(f"hook process of {node.ip} running", lambda: hook.running_and(lambda: hook.popen.pid), timeout=10)
        proc = proc_view(home / "proc", "5e1f0000-0000-4000-8000-00000000b001")
        argv = [sys.executable, "-m", "telemetry", "daemon", "--config", str(daemon_config),
                "--listen", f"{node.ip}:{self.daemon_port}", "--kmsg", str(self.kernel_logs[node.ip].path),
                "--proc-root", str(proc), "--disable-collector", "nvml",  # no NVIDIA driver here
                "--state-dir", str(home / "daemon-state")]
        if node.previous_boot:
            # A boot that ended: the flight recorder writes a few records, the daemon stops, the boot id changes.
            before = start(f"daemon-{node.ip}-previous-boot", argv, self.tmp, env)
            try:
                url = f"http://{node.ip}:{self.daemon_port}/metrics"
                wait_until(f"flight records of {node.ip}'s previous boot", lambda: before.running_and(
                    lambda: (metric(url, "memtel_flight_records_written_total") or 0) >= 3), timeout=60)
            finally:
                before.stop()
            set_boot_id(proc, "5e1f0000-0000-4000-8000-00000000b002")
        self.processes.append(start(f"daemon-{node.ip}", argv, self.tmp, env))

    def _write_targets(self, targets: Path) -> None:
        """One targets file per job, as configs/prometheus/targets/*.yml.example lay them out."""
        for job, port in (("daemon", self.daemon_port), ("hook", self.hook_port), ("vllm", self.vllm_port)):
            groups = []
            for node in self.nodes:
                group: dict[str, Any] = {"targets": [f"{node.ip}:{port}"]}
                if node.label:
                    group["labels"] = {"node": node.label}
                groups.append(group)
            (targets / f"{job}.yml").write_text(yaml.safe_dump(groups))

    def check_running(self) -> None:
        for process in self.processes:
            process.check_running()

    def _serving(self, url: str) -> bool:
        self.check_running()
        return self.client.get(url).status_code == 200

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        if self.webhook is not None:
            self.webhook.stop()
        self.client.close()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.log_tail()}" for p in self.processes)

    def add_huge_page_faults(self, node: LiveNode, alloc: int, fallback: int) -> None:
        """Huge-page faults on the node as the kernel counts them: the thp_fault_alloc and thp_fault_fallback
        counters of its /proc view's vmstat grow (rewritten in place: the daemon keeps the file open)."""
        path = self.tmp / node.ip / "proc" / "vmstat"
        text = path.read_text()
        for name, more in (("thp_fault_alloc", alloc), ("thp_fault_fallback", fallback)):
            match = re.search(rf"^{name} (\d+)$", text, flags=re.MULTILINE)
            assert match, f"{path}: no {name} line"
            text = f"{text[:match.start(1)]}{int(match.group(1)) + more}{text[match.end(1):]}"
        with open(path, "r+") as vmstat:
            vmstat.write(text)
            vmstat.truncate()

    def start_growing(self) -> None:
        """Every hook process leaves rest: growing logits, failing reads, a target that cannot be installed."""
        for hook in self.hooks.values():
            hook.signal(signal.SIGUSR1)

    def prefill(self, node: LiveNode, words: int) -> dict:
        """One completion request of `words` prompt tokens to the node's vLLM-shaped server."""
        response = self.client.post(f"http://{node.ip}:{self.vllm_port}/v1/completions",
                                    json={"model": "lab-stock", "prompt": " ".join(["ka"] * words), "max_tokens": 2},
                                    timeout=60)
        response.raise_for_status()
        return response.json()
