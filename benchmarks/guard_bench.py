"""The latency `memtel guard` adds, against going direct (a benchmark, not a test; results go in BENCHMARKS.md).

An upstream in this process (a stdlib threaded HTTP/1.1 server: a fixed completion JSON, or a stream of
--chunks SSE events --gap-ms apart, each carrying the perf_counter time it was written), a hook exporter
in this process (a static exposition with a limit far above the prompts), and the guard in its own
process (`python -m telemetry guard`, as deployed). One keep-alive client connection each way; the
variants interleave in blocks of 50 so load on a shared machine hits both alike.

1. request: the wall time of a non-streamed /v1/completions (a --prompt-words-word prompt: within the byte
   bound, so no /tokenize), direct and through the guard: p50, p90, p99; added = the difference of p50s;
2. chunk: for each streamed event, its arrival time at the client less the time the upstream wrote it,
   direct and through the guard: p50, p99; added = the difference of p50s.

With --replicas N (N > 1) the guard fronts N such upstreams (`--replica URL=HOOK` each, its /health polled),
and "direct" goes to the first: the guard's choice of the replica with the most room is in the added time.
With --previous TREE, a second guard from another checkout (e.g. `git worktree add /tmp/prev HEAD~3`) runs in
the same blocks as a third variant, so the two guards are measured under the same load.

    PYTHONPATH=. python benchmarks/guard_bench.py [--requests 2000] [--streams 40] [--chunks 50] [--replicas N]
                                                  [--previous TREE] [--json out.json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import machine
from harness.ports import free_port
from telemetry.catalogue.metrics import FORECAST_FIT_BUDGET, FORECAST_LAST_SUCCESS, FORECAST_MAX_PREFILL_TOKENS

ANSWER = json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "bench",
                     "choices": [{"index": 0, "text": " alpha beta gamma delta", "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 100, "completion_tokens": 4, "total_tokens": 104}}).encode()
HOOK_TEXT = "".join(f'{entry.series}{{rank="0",node="bench"}} {value}\n' for entry, value in (
    (FORECAST_MAX_PREFILL_TOKENS, "1000000"), (FORECAST_FIT_BUDGET, "8e9"), (FORECAST_LAST_SUCCESS, "%r")))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def start_upstream(chunks: int, gap_s: float) -> _Server:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # head and body are two writes: without it, a delayed ACK costs 40 ms

        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:  # the hook's /metrics
            data = (HOOK_TEXT % time.time()).encode()  # a fresh forecast: the guard decides, it is not blind
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if not body.get("stream"):
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(ANSWER)))
                self.end_headers()
                self.wfile.write(ANSWER)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(chunks):
                time.sleep(gap_s)
                event = b'data: {"choices":[{"text":" w"}],"t":%r}\n\n' % time.perf_counter()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
            self.wfile.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
            self.wfile.flush()

    server = _Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def start_guard(upstream_ports: list[int], root: Path | None = None) -> tuple[subprocess.Popen, int]:
    """The guard (of the checkout at `root`: this one by default) in front of the upstreams (each its own hook
    too): one as --upstream/--hooks, several as --replica."""
    port = free_port()
    root = root or Path(__file__).resolve().parents[1]
    urls = [f"http://127.0.0.1:{p}" for p in upstream_ports]
    engines = ["--upstream", urls[0], "--hooks", urls[0]] if len(urls) == 1 else \
        [arg for url in urls for arg in ("--replica", f"{url}={url}")]
    process = subprocess.Popen(
        [sys.executable, "-m", "telemetry", "guard", *engines, "--listen", f"127.0.0.1:{port}", "--log-level",
         "WARNING", "--when-blind", "reject"],  # a 200 below means the limit is known: the requests are decided
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "warm"}))
            response = conn.getresponse()
            response.read()
            conn.close()
            if response.status == 200:
                return process, port
        except OSError:
            pass
        time.sleep(0.1)
    process.kill()
    raise SystemExit("the guard did not start")


def one_request(conn: http.client.HTTPConnection, body: bytes) -> float:
    started = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    response.read()
    assert response.status == 200, response.status
    return time.perf_counter() - started


def one_stream(conn: http.client.HTTPConnection, body: bytes) -> list[float]:
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    delays = []
    while True:
        line = response.readline()
        if not line:
            break
        if line.startswith(b"data: {"):
            delays.append(time.perf_counter() - json.loads(line[6:])["t"])
        elif line.startswith(b"data: [DONE]"):
            response.read()
            break
    return delays


def percentiles(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50_ms": statistics.median(values) * 1e3, "p90_ms": q[89] * 1e3, "p99_ms": q[98] * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="non-streamed requests per variant")
    parser.add_argument("--streams", type=int, default=40, help="streamed requests per variant")
    parser.add_argument("--chunks", type=int, default=50, help="events per stream")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="time between events")
    parser.add_argument("--prompt-words", type=int, default=100)
    parser.add_argument("--replicas", type=int, default=1, help="upstreams behind the guard (--replica each)")
    parser.add_argument("--previous", type=Path, default=None, help="another checkout whose guard runs beside")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    upstreams = [start_upstream(args.chunks, args.gap_ms / 1e3) for _ in range(max(1, args.replicas))]
    upstream = upstreams[0]
    guard, guard_port = start_guard([u.server_address[1] for u in upstreams])
    guards = [guard]
    previous_port = None
    if args.previous is not None:
        previous, previous_port = start_guard([u.server_address[1] for u in upstreams], args.previous.resolve())
        guards.append(previous)
    body = json.dumps({"model": "bench", "prompt": "word " * args.prompt_words, "max_tokens": 4}).encode()
    stream_body = json.dumps({"model": "bench", "prompt": "word " * args.prompt_words, "stream": True}).encode()
    try:
        conns = {"direct": http.client.HTTPConnection("127.0.0.1", upstream.server_address[1], timeout=10),
                 "guard": http.client.HTTPConnection("127.0.0.1", guard_port, timeout=10)}
        if previous_port is not None:
            conns["previous"] = http.client.HTTPConnection("127.0.0.1", previous_port, timeout=10)
        times: dict[str, list[float]] = {name: [] for name in conns}
        chunk_delays: dict[str, list[float]] = {name: [] for name in conns}
        for conn in conns.values():  # warm both paths
            for _ in range(50):
                one_request(conn, body)
        block = 50
        for _ in range(max(1, args.requests // block)):
            for name, conn in conns.items():
                times[name].extend(one_request(conn, body) for _ in range(block))
        for _ in range(args.streams):
            for name, conn in conns.items():
                chunk_delays[name].extend(one_stream(conn, stream_body))
        for conn in conns.values():
            conn.close()
    finally:
        for process in guards:
            process.terminate()
            process.wait(10)
        for server in upstreams:
            server.shutdown()
    result: dict[str, Any] = {
        "machine": machine(), "load_average": os.getloadavg(), "requests": len(times["direct"]),
        "replicas": len(upstreams),
        "request": {name: percentiles(values) for name, values in times.items()},
        "chunk": {name: percentiles(values) for name, values in chunk_delays.items()},
        "chunks": len(chunk_delays["direct"]),
    }
    result["added_request_p50_ms"] = result["request"]["guard"]["p50_ms"] - result["request"]["direct"]["p50_ms"]
    result["added_chunk_p50_ms"] = result["chunk"]["guard"]["p50_ms"] - result["chunk"]["direct"]["p50_ms"]
    if "previous" in times:
        result["previous"] = str(args.previous)
        result["previous_added_request_p50_ms"] = (result["request"]["previous"]["p50_ms"]
                                                   - result["request"]["direct"]["p50_ms"])
        result["previous_added_chunk_p50_ms"] = (result["chunk"]["previous"]["p50_ms"]
                                                 - result["chunk"]["direct"]["p50_ms"])
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
