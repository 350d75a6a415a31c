"""The reported collapse as a scrape target, and a watch that times the alerts it raises.

`CollapseSource` is a small HTTP server that serves the daemon's headroom series as the collapse replays:
steady 29 GiB of headroom, then (from `collapse()`) a straight fall to 2.5 GiB over 9 s, then 2.5 GiB; the
contiguous free memory is what falls, MemAvailable stays at 60 GiB of 120 GiB. Prometheus scrapes it as the
memtel-daemon job (a targets file named daemon-*.yml), under its own node label.

`CollapseWatch` starts the fall and polls /api/v1/alerts every 0.1 s from its own thread until both headroom
alerts fire on the source's node (or its deadline passes), keeping when each first fired (seconds after the
fall began, monotonic clock) and the alert as Prometheus showed it then. The live stack starts it once the
source's steady state is in Prometheus, so the fall runs while other tests do; test_live_prometheus_collapse.py
reads what it saw.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

GiB = 1 << 30
STEADY = 29 * GiB
FLOOR = int(2.5 * GiB)
FALL_S = 9.0
MEM_AVAILABLE = 60 * GiB
MEM_TOTAL = 120 * GiB
NODE = "spark-collapse"
FALLING_WITHIN_S = 5.0   # issue 11: "must fire within 5 s of the collapse"
# The floor alert: the fall crosses 4 GiB about 8.1 s in; `for: 15s`; a second each of scrape and evaluation.
FLOOR_ALERTS_WITHIN_S = 8.1 + 15 + 3
WATCHED = ("MemtelUnifiedHeadroomFalling", "MemtelUnifiedHeadroomLow")
STEADY_SAMPLES_NEEDED = 8  # the falling rule's 8 s fit window, full of steady samples before the fall
STEADY_WAIT_S = 30.0  # at most this long for a moment with the window full, before the fall starts
STEADY_QUERY = f'count_over_time(memtel_node_unified_headroom_bytes{{node="{NODE}"}}[{STEADY_SAMPLES_NEEDED}s])'


class CollapseSource:
    """Serves the daemon's headroom series; `collapse()` starts the fall (monotonic clock)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.collapse_started: float | None = None
        source = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = source.exposition().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.address = f"{host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()

    def targets(self) -> list[dict]:
        """The source as a targets-file group, with its node label."""
        return [{"targets": [self.address], "labels": {"node": NODE}}]

    def collapse(self) -> float:
        self.collapse_started = time.monotonic()
        return self.collapse_started

    def headroom(self) -> float:
        if self.collapse_started is None:
            return STEADY
        progress = min((time.monotonic() - self.collapse_started) / FALL_S, 1.0)
        return STEADY - (STEADY - FLOOR) * progress

    def exposition(self) -> str:
        headroom = self.headroom()
        return "".join(f"{line}\n" for line in (
            f"memtel_node_unified_headroom_bytes {headroom:.0f}",
            f"memtel_node_mem_free_contiguous_bytes {headroom:.0f}",
            f"memtel_node_mem_available_bytes {MEM_AVAILABLE}",
            f"memtel_node_mem_total_bytes {MEM_TOTAL}",
            'memtel_collector_success{collector="kmsg"} 1',
        ))

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class CollapseWatch:
    """Starts the fall and times the headroom alerts on the source's node (see the module's docstring)."""

    def __init__(self, source: CollapseSource, prometheus_url: str) -> None:
        self.source = source
        self.url = prometheus_url
        self.seen: dict[str, float] = {}      # alert name -> seconds after the fall began
        self.first: dict[str, dict] = {}      # alert name -> the alert when first seen firing
        self.errors: list[str] = []
        self.started: float | None = None
        self.started_unix = 0.0
        self.steady_samples = 0.0  # samples in the fit window when the fall began
        self.ended_unix: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="collapse-watch", daemon=True)

    def start(self) -> None:
        """Start the fall at a moment the fit window is full of steady samples (checked again here, the stack's
        settle wait having been a few queries ago: a scrape a little late on a loaded machine leaves 7 of 8 in
        the window for a second), waiting at most STEADY_WAIT_S for one."""
        deadline = time.monotonic() + STEADY_WAIT_S
        while True:
            rows = httpx.get(f"{self.url}/api/v1/query", params={"query": STEADY_QUERY}, timeout=5.0).json()
            self.steady_samples = max((float(r["value"][1]) for r in rows["data"]["result"]), default=0.0)
            if self.steady_samples >= STEADY_SAMPLES_NEEDED or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        self.started = self.source.collapse()
        self.started_unix = time.time()
        self._thread.start()

    def _watch(self) -> None:
        assert self.started is not None
        deadline = self.started + FLOOR_ALERTS_WITHIN_S + 5
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline and len(self.seen) < len(WATCHED) and not self._stop.is_set():
                try:
                    alerts = client.get(f"{self.url}/api/v1/alerts").json()["data"]["alerts"]
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    self.errors.append(str(exc))
                    alerts = []
                now = time.monotonic() - self.started
                for alert in alerts:
                    name = alert["labels"].get("alertname")
                    if (name in WATCHED and name not in self.seen and alert["state"] == "firing"
                            and alert["labels"].get("node") == NODE):
                        self.seen[name] = now
                        self.first[name] = alert
                self._stop.wait(0.1)
        self.ended_unix = time.time()

    def result(self, timeout: float = FLOOR_ALERTS_WITHIN_S + 30) -> CollapseWatch:
        """Wait for the watch to end (it has a deadline of its own); itself."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("the collapse watch did not end")
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
