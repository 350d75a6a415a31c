"""The exporter's cost per scrape: this tree's server against another checkout's, scrapes paired round by round.

    .venv/bin/python benchmarks/exporter_bench.py --baseline DIR [--scrapes 2000] [--rounds 3] [--out FILE]

Each target is its own process serving a fixed registry: the families of a golden /metrics file (the hook's,
tests/fixtures/hook/, and the daemon's, tests/fixtures/daemon/), so the body has the shape each real exporter
serves while collecting costs next to nothing: what is measured is the HTTP server and the rendering, the parts
telemetry/exporter owns. The hook's body is served through the hook's own server class (telemetry/hook/exporter.py,
/snapshot route included). Targets, per body:
  - `baseline`: the --baseline checkout's exporter (e.g. `git archive HEAD | tar -x -C DIR` before a change);
  - `this`: this tree's exporter as it ships;
  - `this+generate_latest`: this tree's exporter with /metrics rendered by prometheus_client's `generate_latest`
    (what telemetry/exporter/exposition.py replaces; the same bytes).
With `--values changing` (the default) every sample's value is new on every scrape, as a busy process's
counters are, so nothing a renderer remembers between scrapes is a value. Scrapes interleave round-robin over
the targets through one keep-alive client each (as Prometheus scrapes). Per target: the server process's CPU
(utime+stime) per scrape, which a loaded machine disturbs least, and the client's p50/p99 latency. Prints a
JSON summary; a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.machine import machine  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
BODIES = {
    "hook": ROOT / "tests/fixtures/hook/metrics.golden-sequence__meminfo.x86_64-debian12-24g.prom",
    "daemon": ROOT / "tests/fixtures/daemon/metrics.x86_64-debian12-24g__dgx-spark-kmsg.prom",
}
# The server process: the families of a golden file (its masked values, such as <volatile>, read as 1).
SERVER = r"""
import re, sys, time
from pathlib import Path
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

body, port, render, changing = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[5] == "changing"
text = re.sub(r" (<[a-z]+>|[A-Z][A-Z_]+)$", " 1", Path(sys.argv[4]).read_text(), flags=re.M)
families = list(text_string_to_metric_families(text))
samples = [list(f.samples) for f in families]

class Fixed:
    scrapes = 0

    def collect(self):
        if changing:  # every value new on every scrape, as a busy process's counters are
            Fixed.scrapes += 1
            for family, originals in zip(families, samples):
                family.samples = [s._replace(value=s.value + Fixed.scrapes) for s in originals]
        return iter(families)

if body == "hook":
    from telemetry.hook.exporter import start_exporter
    server = start_exporter(Fixed(), "127.0.0.1", port, snapshot=lambda: None)
else:
    from telemetry.exporter import MetricsServer
    server = MetricsServer("127.0.0.1", port, Fixed(), name="memtel-bench")
    server.start()
if render == "generate_latest":
    from telemetry.exporter.shared_collection import SharedCollection
    server._collection = SharedCollection(lambda: generate_latest(server.registry))
print("ready", flush=True)
while True:
    time.sleep(3600)
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def start(tree: Path, body: str, render: str, values: str) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, body, str(port), render, str(BODIES[body]), values],
                            cwd=tree,
                            env={**os.environ, "PYTHONPATH": str(tree)}, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise SystemExit(f"the {body} server of {tree} did not start")
    return proc, f"http://127.0.0.1:{port}/metrics"


def measure(targets: dict[str, tuple[subprocess.Popen[str], str]], scrapes: int) -> dict[str, dict[str, float]]:
    clients = {name: httpx.Client(timeout=10) for name in targets}
    times: dict[str, list[float]] = {name: [] for name in targets}
    bodies: dict[str, bytes] = {}
    try:
        for name, (_proc, url) in targets.items():  # warm-up
            for _ in range(50):
                bodies[name] = clients[name].get(url).content
        cpu0 = {name: cpu_seconds(proc.pid) for name, (proc, _url) in targets.items()}
        for _ in range(scrapes):
            for name, (_proc, url) in targets.items():
                started = time.perf_counter()
                response = clients[name].get(url)
                times[name].append(time.perf_counter() - started)
                assert response.status_code == 200
        cpu1 = {name: cpu_seconds(proc.pid) for name, (proc, _url) in targets.items()}
    finally:
        for client in clients.values():
            client.close()
    sizes = {len(b) for b in bodies.values()}
    return {name: {"cpu_us_per_scrape": (cpu1[name] - cpu0[name]) / scrapes * 1e6,
                   "p50_ms": percentile(t, 50) * 1e3, "p99_ms": percentile(t, 99) * 1e3,
                   "mean_ms": statistics.fmean(t) * 1e3, "bytes": len(bodies[name]), "same_size": len(sizes) == 1}
            for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, metavar="DIR", help="another checkout's root")
    parser.add_argument("--scrapes", type=int, default=2000, help="scrapes per target per round (default 2000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each with fresh servers (default 3)")
    parser.add_argument("--bodies", default="hook,daemon", help="which golden bodies (default hook,daemon)")
    parser.add_argument("--values", choices=("changing", "fixed"), default="changing",
                        help="every sample's value new on every scrape (default), or the golden file's throughout")
    parser.add_argument("--out", type=Path, help="also write the JSON summary here")
    args = parser.parse_args(argv)
    if not (args.baseline / "telemetry" / "exporter").is_dir():
        print(f"exporter_bench: error: --baseline {args.baseline}: not a memtel checkout (expected "
              "telemetry/exporter/ in it)", file=sys.stderr)
        return 2
    summary: dict[str, object] = {"machine": machine(), "load_average": os.getloadavg(), "scrapes": args.scrapes,
                                  "values": args.values, "rounds": []}
    for round_number in range(args.rounds):
        result: dict[str, object] = {}
        for body in args.bodies.split(","):
            procs = {"baseline": start(args.baseline, body, "shipped", args.values),
                     "this": start(ROOT, body, "shipped", args.values),
                     "this+generate_latest": start(ROOT, body, "generate_latest", args.values)}
            try:
                result[body] = measure(procs, args.scrapes)
            finally:
                for proc, _url in procs.values():
                    proc.kill()
                    proc.wait()
        result["load_average"] = os.getloadavg()
        print(json.dumps({"round": round_number, **result}), flush=True)
        summary["rounds"].append(result)  # type: ignore[attr-defined]
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
