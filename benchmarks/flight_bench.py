"""Flight recorder and the new node signals (buddyinfo, headroom, unaccounted): what they cost the daemon.

    .venv/bin/python benchmarks/flight_bench.py [--scrapes 1000] [--cpu-seconds 60] [--records 300]
                                                [--state-dir DIR] [--baseline-tree DIR] [--out FILE]

Two real daemons side by side on loopback, each scraped through one keep-alive client (as Prometheus does):
  - `with_recorder`: the defaults of this version (every collector, buddyinfo and headroom included) with the
    flight recorder on (1 record a second, fdatasync each), following /dev/kmsg;
  - `without`: the collector set of the previous version (`--disable-collector buddyinfo/headroom`) and
    `--no-flight-recorder`;
  - with --baseline-tree DIR, a third: the daemon of another source tree (say the last commit) with its defaults,
    so a busy machine's slowdown can be told from the code's.
Measured: scrape p50/p99 over --scrapes interleaved scrapes; CPU (utime+stime over wall) during
--cpu-seconds at one scrape per second each; the recorder's own gauges sampled once a second meanwhile
(bytes per record, write + fdatasync time). Then, in process, --records records of the same series written
back to back into a ring in --state-dir (default: a new directory under /var/tmp, a disk, not tmpfs) to time
pwrite + fdatasync alone. Goals (issue 11): under 1 % of a core at a 1 s scrape with the recorder on, scrape
p50 at most 5 ms. Prints a JSON summary; this is a benchmark, not a test.
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
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.daemon_bench import cpu_seconds, percentile, start_daemon, wait_http  # noqa: E402
from benchmarks.machine import machine  # noqa: E402
from telemetry.catalogue import FAMILIES  # noqa: E402
from telemetry.catalogue.metrics import (  # noqa: E402
    COLLECTOR_DURATION,
    FLIGHT_LAST_RECORD_BYTES,
    FLIGHT_LAST_WRITE_DURATION,
)
from telemetry.flight.recorder import FlightRecorder, series_key  # noqa: E402
from tests.support.ports import free_port  # noqa: E402


def values_of(text: str) -> dict[str, float]:
    return {series_key(s.name, s.labels): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def scrape_latency(urls: dict[str, str], pids: dict[str, int], scrapes: int) -> dict[str, dict[str, float]]:
    """Wall time per scrape (p50, p99, mean) and the daemon's CPU per scrape (less sensitive to a busy machine)."""
    clients = {name: httpx.Client(timeout=10) for name in urls}
    times: dict[str, list[float]] = {name: [] for name in urls}
    sizes: dict[str, int] = {}
    try:
        for name, url in urls.items():
            for _ in range(20):
                clients[name].get(url)
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        for _ in range(scrapes):
            for name, url in urls.items():
                started = time.perf_counter()
                response = clients[name].get(url)
                times[name].append(time.perf_counter() - started)
                assert response.status_code == 200
                sizes[name] = len(response.content)
        cpu = {name: (cpu_seconds(pid) - cpu_before[name]) / scrapes for name, pid in pids.items()}
    finally:
        for client in clients.values():
            client.close()
    return {name: {"p50_ms": percentile(t, 50) * 1e3, "p99_ms": percentile(t, 99) * 1e3,
                   "mean_ms": statistics.fmean(t) * 1e3, "daemon_cpu_ms_per_scrape": cpu[name] * 1e3,
                   "body_bytes": sizes[name]} for name, t in times.items()}


def cpu_at_one_scrape_a_second(urls: dict[str, str], pids: dict[str, int], seconds: int) -> dict:
    start_cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
    record_bytes: list[float] = []
    write_seconds: list[float] = []
    start = time.monotonic()
    with httpx.Client(timeout=10) as client:
        for i in range(seconds):
            for name, url in urls.items():
                text = client.get(url).text
                if name == "with_recorder":
                    values = values_of(text)
                    record_bytes.append(values[FLIGHT_LAST_RECORD_BYTES.series])
                    write_seconds.append(values[FLIGHT_LAST_WRITE_DURATION.series])
            time.sleep(max(0.0, start + i + 1 - time.monotonic()))
    wall = time.monotonic() - start
    return {
        "cpu_percent_of_a_core": {name: (cpu_seconds(pid) - start_cpu[name]) / wall * 100
                                  for name, pid in pids.items()},
        "record_bytes": {"mean": statistics.fmean(record_bytes), "max": max(record_bytes)},
        "daemon_write_fdatasync_ms": {"p50": percentile(write_seconds, 50) * 1e3,
                                      "p99": percentile(write_seconds, 99) * 1e3, "max": max(write_seconds) * 1e3},
    }


def ring_writes(state_dir: Path, values: dict[str, float], records: int) -> dict:
    recorder = FlightRecorder(state_dir / "bench-flight", "bench-boot", duration_seconds=900)
    assert recorder.record(values)  # creates the ring (not timed)
    write, total = [], []
    for _ in range(records):
        started = time.perf_counter()
        assert recorder.record(values)
        total.append(time.perf_counter() - started)
        assert recorder.last_write_seconds is not None
        write.append(recorder.last_write_seconds)
    recorder.stop()
    ring = state_dir / "bench-flight" / "current.ring"
    return {"records": records, "series_per_record": len(values), "record_bytes": recorder.last_record_bytes,
            "ring_file_bytes": ring.stat().st_size,
            "write_fdatasync_ms": {"p50": percentile(write, 50) * 1e3, "p99": percentile(write, 99) * 1e3},
            "encode_write_fdatasync_ms": {"p50": percentile(total, 50) * 1e3, "p99": percentile(total, 99) * 1e3}}


def file_system(path: Path) -> str:
    result = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True)
    fields = result.stdout.splitlines()[-1].split() if result.returncode == 0 else ["?", "?"]
    return f"{fields[0]} ({fields[1]})"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--scrapes", type=int, default=1000, help="scrapes per daemon (default 1000)")
    parser.add_argument("--cpu-seconds", type=int, default=60, help="CPU window at 1 scrape/s (default 60)")
    parser.add_argument("--records", type=int, default=300, help="records for the in-process write timing")
    parser.add_argument("--state-dir", type=Path, help="where the rings go (default: a new dir under /var/tmp)")
    parser.add_argument("--baseline-tree", type=Path,
                        help="also run the daemon of another source tree with its defaults, e.g. the last commit: "
                             "mkdir /tmp/head && git archive HEAD | tar -x -C /tmp/head")
    parser.add_argument("--out", type=Path, help="also write the JSON summary here")
    args = parser.parse_args()
    if args.baseline_tree is not None and not (args.baseline_tree / "telemetry" / "daemon").is_dir():
        parser.error(f"--baseline-tree {args.baseline_tree}: not a memtel source tree (no telemetry/daemon)")
    if min(args.scrapes, args.cpu_seconds, args.records) < 1:
        parser.error("--scrapes, --cpu-seconds and --records must be at least 1")

    base = args.state_dir or Path(tempfile.mkdtemp(prefix="memtel-flight-bench-", dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    ports = {"with_recorder": free_port(), "without": free_port()}
    procs = {
        "with_recorder": start_daemon(ports["with_recorder"], str(base / "with")),
        "without": start_daemon(ports["without"], str(base / "without"), "--no-flight-recorder",
                                "--disable-collector", "buddyinfo", "--disable-collector", "headroom"),
    }
    if args.baseline_tree is not None:
        ports["baseline_tree"] = free_port()
        procs["baseline_tree"] = start_daemon(ports["baseline_tree"], str(base / "baseline"), tree=args.baseline_tree)
    urls = {name: f"http://127.0.0.1:{port}/metrics" for name, port in ports.items()}
    try:
        for name, url in urls.items():
            wait_http(url, procs[name])
        result: dict = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": machine(),
            "load_average_1m_at_start": os.getloadavg()[0],
            "state_dir_file_system": file_system(base),
            "command": "python benchmarks/flight_bench.py " + " ".join(sys.argv[1:]),
            "scrape_latency": scrape_latency(urls, {n: p.pid for n, p in procs.items()}, args.scrapes),
        }
        result.update(cpu_at_one_scrape_a_second(urls, {n: p.pid for n, p in procs.items()}, args.cpu_seconds))
        series = values_of(httpx.get(urls["with_recorder"], timeout=10).text)
        not_recorded = (*(name for entry in FAMILIES.values() if entry.source in ("flight", "exporter")
                          for name in entry.sample_names), COLLECTOR_DURATION.series, "process_")
        recorded = {k: v for k, v in series.items() if not k.startswith(not_recorded)}
        result["ring_writes_in_process"] = ring_writes(base, recorded, args.records)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        if args.state_dir is None:
            shutil.rmtree(base, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
