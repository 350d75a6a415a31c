"""The live benign run of issue 20 (opt-in; docs/alerts.md, "The live burn-in"): 15+ minutes of a page cache
filled from files larger than memory, churned and dropped, with the memtel daemon and a live Prometheus running
the shipped rules; then what fired, live and as scored by `memtel alerts score` on the daemon's own flight
recording.

    sudo .venv/bin/python -m benchmarks.alerts_burnin_live --cache-dir /var/tmp/memtel-burn-in \\
        [--minutes 16] [--cache-gib 28] [--save tests/fixtures/alerts/corpus/page-cache-churn-live.jsonl.gz]

Needs root (drop_caches), Debian's prometheus package and `--cache-gib` of free disk (checked first). Every
process it starts is stopped on every exit path; the cache files are kept for the next run unless
--remove-files. It takes the wall time asked for but little CPU (reading files).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from benchmarks.machine import machine
from telemetry.alerts.score import as_text, score
from telemetry.alerts.timeline import Outcome, Record, Timeline
from telemetry.catalogue.metrics import UNIFIED_HEADROOM, UNIFIED_HEADROOM_WITHOUT_RECLAIM

GIB = 1 << 30
RULES = Path(__file__).resolve().parents[1] / "dashboards" / "prometheus"
RULE_FILES = [RULES / "memtel-recording.yml", RULES / "memtel-alerts.yml"]
NODE = "burn-in"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fill_files(directory: Path, total_gib: int) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    chunk = os.urandom(1 << 20) * 16
    paths = []
    for i in range(total_gib // 4):
        path = directory / f"cache-{i}.bin"
        if not path.exists() or path.stat().st_size != 4 * GIB:
            with open(path, "wb") as out:
                for _ in range(4 * GIB // len(chunk)):
                    out.write(chunk)
        paths.append(path)
    return paths


def read_through(path: Path, budget_s: float) -> None:
    buffer = bytearray(8 << 20)
    end = time.monotonic() + budget_s
    with open(path, "rb") as source:
        while source.readinto(buffer) and time.monotonic() < end:
            pass


def drop_caches() -> None:
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)["data"]["result"]


def wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"{url} did not answer within {timeout:g} s")


def stop(process: subprocess.Popen | None) -> None:
    if process is not None and process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_live(args: argparse.Namespace, paths: list[Path], scratch: Path, daemon_log, prometheus_log) -> dict:
    """The daemon, Prometheus with the shipped rules and the page-cache churn; what fired, live."""
    daemon = prometheus = None
    daemon_port, prom_port = free_port(), free_port()
    try:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "telemetry", "daemon", "--state-dir", str(scratch / "state"),
             "--listen", f"127.0.0.1:{daemon_port}", "--flight-duration", f"{int(args.minutes * 60) + 300}s",
             "--log-level", "warning"], stdout=daemon_log, stderr=subprocess.STDOUT)
        wait_http(f"http://127.0.0.1:{daemon_port}/metrics", 60)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                       "external_labels": {"runbook_base": "runbook.md"}},
            "rule_files": [str(p) for p in RULE_FILES],
            "scrape_configs": [{"job_name": "memtel-daemon", "static_configs": [
                {"targets": [f"127.0.0.1:{daemon_port}"], "labels": {"node": NODE}}]}],
        }
        (scratch / "prometheus.yml").write_text(json.dumps(config))
        prometheus = subprocess.Popen(
            ["prometheus", f"--config.file={scratch / 'prometheus.yml'}", f"--storage.tsdb.path={scratch / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=prometheus_log, stderr=subprocess.STDOUT)
        wait_http(f"http://127.0.0.1:{prom_port}/-/ready", 60)
        rng = random.Random(20)
        end = time.monotonic() + args.minutes * 60
        next_drop = time.monotonic() + args.drop_every_s
        drops = reads = 0
        while time.monotonic() < end:
            if time.monotonic() >= next_drop:
                drop_caches()
                drops += 1
                next_drop += args.drop_every_s
            read_through(rng.choice(paths), min(30.0, max(end - time.monotonic(), 0.1)))
            reads += 1
        minutes = int(args.minutes) + 1
        return {
            "reads": reads, "drops": drops,
            "fired": query(prom_port, f'max_over_time(ALERTS{{alertstate="firing"}}[{minutes}m])'),
            "seconds": query(prom_port, f'count_over_time(ALERTS{{alertstate="firing"}}[{minutes}m])'),
            "lowest": query(prom_port, f"min_over_time({UNIFIED_HEADROOM.series}[{minutes}m])"),
            "lowest_old": query(prom_port, f"min_over_time({UNIFIED_HEADROOM_WITHOUT_RECLAIM.series}[{minutes}m])"),
        }
    finally:
        stop(prometheus)
        stop(daemon)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", required=True, type=Path)
    parser.add_argument("--cache-gib", type=int, default=28)
    parser.add_argument("--minutes", type=float, default=16.0)
    parser.add_argument("--drop-every-s", type=float, default=300.0)
    parser.add_argument("--save", type=Path, help="write the recorded timeline here (.jsonl.gz)")
    parser.add_argument("--out", type=Path, help="write the summary here (JSON)")
    parser.add_argument("--remove-files", action="store_true")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (drop_caches)")
    if shutil.which("prometheus") is None:
        raise SystemExit("needs Debian's prometheus package")
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    have = sum(p.stat().st_size for p in args.cache_dir.glob("cache-*.bin"))
    free = shutil.disk_usage(args.cache_dir).free
    if free + have < args.cache_gib * GIB + 10 * GIB:
        raise SystemExit(f"{args.cache_dir}: {free / GIB:.0f} GiB free; need {args.cache_gib} GiB plus 10 spare")
    paths = fill_files(args.cache_dir, args.cache_gib)
    scratch = Path(tempfile.mkdtemp(prefix="memtel-burn-in-live-"))
    started = time.time()
    with open(scratch / "daemon.log", "wb") as daemon_log, open(scratch / "prometheus.log", "wb") as prometheus_log:
        live = run_live(args, paths, scratch, daemon_log, prometheus_log)
    from telemetry.flight.ring import read_ring

    ring = read_ring(scratch / "state" / "flight" / "current.ring")
    records = [Record(r.time, dict(r.values)) for r in ring.records if r.time >= started]
    outcome = Outcome("benign", node=NODE, description=(
        f"Live on {machine()}: page cache filled from {args.cache_gib} GiB of files, churned and dropped every "
        f"{args.drop_every_s:g} s for {args.minutes:g} min ({time.strftime('%Y-%m-%d', time.gmtime(started))})."))
    timeline = Timeline("page-cache-churn-live", outcome, tuple(records))
    scored = score([timeline], RULE_FILES)
    if args.save:
        lines = [json.dumps({"memtel_timeline": {"outcome": "benign", "node": NODE,
                                                 "description": outcome.description}})]
        lines += [json.dumps({"time": r.time, "values": r.values}, sort_keys=True) for r in records]
        args.save.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode(), mtime=0))
    summary = {
        "machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "minutes": args.minutes, "records": len(records), "reads": live["reads"], "drops": live["drops"],
        "live_fired": {r["metric"]["alertname"]: r["metric"].get("severity", "") for r in live["fired"]},
        "live_firing_seconds": {r["metric"]["alertname"]: float(r["value"][1]) for r in live["seconds"]},
        "lowest_headroom_gib": [float(r["value"][1]) / GIB for r in live["lowest"]],
        "lowest_headroom_without_reclaim_gib": [float(r["value"][1]) / GIB for r in live["lowest_old"]],
        "scored_problems": scored.problems,
    }
    print(as_text(scored))
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    if args.remove_files:
        for path in paths:
            path.unlink()
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
