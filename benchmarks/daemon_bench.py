"""Node daemon benchmark: scrape latency beside node_exporter, idle CPU, kernel line -> counter latency.

    .venv/bin/python benchmarks/daemon_bench.py [--scrapes 1000] [--idle-seconds 60] [--lines 30] [--out FILE]

Runs, side by side on loopback ports:
  - Debian's prometheus-node-exporter limited to meminfo, vmstat and pressure
    (--collector.disable-defaults --collector.meminfo --collector.vmstat --collector.pressure);
  - `memtel daemon` with only the same three sources (like for like: every other collector and the flight
    recorder off);
  - `memtel daemon` with its defaults (all collectors, following /dev/kmsg).
With `--baseline DIR`, the same two daemons of another checkout run beside them (before/after, same load).
Scrapes are interleaved round-robin through one keep-alive client per target (as Prometheus does).
Idle CPU: the default daemon's utime+stime over `--idle-seconds` of one scrape per second.
Line -> counter: a unique line written into /dev/kmsg (root, and only with MEMTEL_TEST_KMSG=1: it writes
into the machine's kernel log, through tests/support/kmsg.py, marked "memtel-test:" so no other memtel
daemon counts it), then /metrics polled every 2 ms until the matching counter rises.
Goals (issue 3): p50 <= node_exporter's and <= 5 ms; idle CPU <= 1 % of a core; line -> counter <= 1 s.
Prints a JSON summary; this is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.machine import machine  # noqa: E402
from telemetry.catalogue.metrics import KERNEL_PATTERN  # noqa: E402
from tests.support.kmsg import DAEMON_COUNTS_TEST_LINES, SKIP_REASON, opted_in, write_kmsg  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def argv0(proc: subprocess.Popen) -> str:
    args = proc.args
    return str(args[0]) if isinstance(args, (list, tuple)) else str(args)


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{argv0(proc)} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.05)
    raise SystemExit(f"{url} not ready after {timeout}s")


def start_node_exporter(port: int) -> subprocess.Popen:
    binary = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
    if binary is None:
        raise SystemExit("prometheus-node-exporter not found: apt-get install -y prometheus-node-exporter")
    return subprocess.Popen(
        [binary, f"--web.listen-address=127.0.0.1:{port}", "--collector.disable-defaults",
         "--collector.meminfo", "--collector.vmstat", "--collector.pressure"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def start_daemon(port: int, state_dir: str, *extra: str, tree: Path = ROOT) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree)}  # `tree`: this checkout, or a --baseline one
    return subprocess.Popen(
        [sys.executable, "-m", "telemetry", "daemon", "--listen", f"127.0.0.1:{port}", "--state-dir", state_dir,
         "--log-level", "warning", *extra],
        cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def same_sources_flags() -> list[str]:
    """Every collector off but meminfo, vmstat and pressure (node_exporter's three), and no flight recorder."""
    from telemetry.daemon.collectors import NAMES

    others = [name for name in NAMES if name not in ("meminfo", "vmstat", "pressure")]
    flags = [flag for name in others for flag in ("--disable-collector", name)]
    help_text = subprocess.run([sys.executable, "-m", "telemetry", "daemon", "--help"], cwd=ROOT,
                               capture_output=True, text=True).stdout
    return flags + (["--no-flight-recorder"] if "--no-flight-recorder" in help_text else [])


def scrape_latency(targets: dict[str, str], scrapes: int) -> dict[str, dict[str, float]]:
    clients = {name: httpx.Client(timeout=10) for name in targets}
    times: dict[str, list[float]] = {name: [] for name in targets}
    sizes: dict[str, int] = {}
    try:
        for name, url in targets.items():  # warm-up: connections, first-scrape caches
            for _ in range(20):
                clients[name].get(url)
        for _ in range(scrapes):
            for name, url in targets.items():
                started = time.perf_counter()
                response = clients[name].get(url)
                body = response.content
                times[name].append(time.perf_counter() - started)
                assert response.status_code == 200
                sizes[name] = len(body)
    finally:
        for client in clients.values():
            client.close()
    return {
        name: {"p50_ms": percentile(t, 50) * 1e3, "p99_ms": percentile(t, 99) * 1e3,
               "mean_ms": statistics.fmean(t) * 1e3, "bytes": sizes[name]}
        for name, t in times.items()
    }


def idle_cpu(pid: int, url: str, seconds: int, compare: dict[str, int]) -> dict[str, float]:
    pids = {"memtel_default": pid, **compare}
    start_cpu = {name: cpu_seconds(p) for name, p in pids.items()}
    start = time.monotonic()
    with httpx.Client(timeout=10) as client:
        for i in range(seconds):
            client.get(url)
            for name in compare:
                client.get(COMPARE_URLS[name])
            time.sleep(max(0.0, start + i + 1 - time.monotonic()))
    wall = time.monotonic() - start
    return {name: (cpu_seconds(p) - start_cpu[name]) / wall * 100 for name, p in pids.items()}


COMPARE_URLS: dict[str, str] = {}


def line_to_counter(url: str, pattern: str, token: str, lines: int) -> dict[str, float]:
    latencies = []
    metric = f'{KERNEL_PATTERN[0].series}{{pattern="{pattern}"}} '
    with httpx.Client(timeout=10) as client:

        def current() -> float:
            for line in client.get(url).text.splitlines():
                if line.startswith(metric):
                    return float(line.split()[-1])
            return 0.0

        for i in range(lines):
            before = current()
            text = (f"NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) "
                    f"returned from _memdescAllocInternal(pMemDesc) @ mem_desc.c:1359 {token} {i}")
            started = time.perf_counter()
            write_kmsg([text], pace_every=0)
            while current() <= before:
                if time.perf_counter() - started > 10:
                    raise SystemExit("line not counted within 10 s")
                time.sleep(0.002)
            latencies.append(time.perf_counter() - started)
            time.sleep(0.1)
    return {"p50_ms": percentile(latencies, 50) * 1e3, "max_ms": max(latencies) * 1e3, "lines": lines}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scrapes", type=int, default=1000, help="scrapes per target (default 1000)")
    parser.add_argument("--idle-seconds", type=int, default=60, help="idle CPU window at 1 scrape/s (default 60)")
    parser.add_argument("--lines", type=int, default=30, help="kernel lines for the line->counter latency")
    parser.add_argument("--out", type=Path, help="also write the JSON summary here")
    parser.add_argument("--baseline", type=Path, metavar="DIR",
                        help="also run the daemon of another checkout (e.g. `git archive HEAD | tar -x -C DIR`) with "
                             "the same sources and its defaults, interleaved: before/after on one busy machine")
    args = parser.parse_args()

    token = f"memtel-bench-{uuid.uuid4().hex[:10]}"
    names = ["node_exporter", "memtel_same_sources", "memtel_default"]
    if args.baseline:
        names += ["baseline_same_sources", "baseline_default"]
    ports = {name: free_port() for name in names}
    state = tempfile.mkdtemp(prefix="memtel-bench-")
    procs = {
        "node_exporter": start_node_exporter(ports["node_exporter"]),
        "memtel_same_sources": start_daemon(ports["memtel_same_sources"], state + "/a", *same_sources_flags()),
        "memtel_default": start_daemon(ports["memtel_default"], state + "/b", "--kmsg-pattern", f"bench={token}",
                                       *DAEMON_COUNTS_TEST_LINES),
    }
    if args.baseline:
        same = ("--disable-collector", "nvml", "--disable-collector", "processes", "--disable-collector", "kmsg")
        procs["baseline_same_sources"] = start_daemon(ports["baseline_same_sources"], state + "/c", *same,
                                                      tree=args.baseline.resolve())
        procs["baseline_default"] = start_daemon(ports["baseline_default"], state + "/d", tree=args.baseline.resolve())
    urls = {name: f"http://127.0.0.1:{port}/metrics" for name, port in ports.items()}
    try:
        for name, url in urls.items():
            wait_http(url, procs[name])
        version = subprocess.run([argv0(procs["node_exporter"]), "--version"], capture_output=True, text=True)
        result = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": machine(),
            "load_average_1m_at_start": os.getloadavg()[0],  # the machine is shared: say how busy it was
            "node_exporter": (version.stdout or version.stderr).splitlines()[0],
            "command": "python benchmarks/daemon_bench.py " + " ".join(sys.argv[1:]),
            "scrape_latency": scrape_latency(urls, args.scrapes),
        }
        compare = {name: procs[name].pid for name in names if name in ("node_exporter", "baseline_default")}
        COMPARE_URLS.update({name: urls[name] for name in compare})
        result["idle_cpu_percent_of_a_core"] = idle_cpu(
            procs["memtel_default"].pid, urls["memtel_default"], args.idle_seconds, compare,
        )
        if opted_in():
            result["line_to_counter"] = line_to_counter(urls["memtel_default"], "bench", token, args.lines)
        else:
            result["line_to_counter"] = f"not measured: {SKIP_REASON}"
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(state, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
