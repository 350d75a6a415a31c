"""The reported collapse, live: a real Prometheus with the shipped config and rules must raise
MemtelUnifiedHeadroomFalling within 5 s of a 29 GiB -> 2.5 GiB fall over 9 s that starts from a steady
state, while MemAvailable stays high throughout; MemtelUnifiedHeadroomLow follows once the floor is crossed
(MemtelContiguousMemoryExhausted needs failing huge-page faults, which this source does not serve), and the
MemAvailable alerts stay quiet.

The source is a small HTTP server in this test that serves the daemon's metric names as the collapse
replays (steady 29 GiB of headroom, then a straight fall to 2.5 GiB over 9 s, then 2.5 GiB; the
contiguous free memory is what falls, MemAvailable stays at 60 GiB). Prometheus scrapes it as the
memtel-daemon job of configs/prometheus/prometheus.yml (its 1 s scrape) and evaluates every second.
Times are measured from the moment the source starts falling to the moment /api/v1/alerts shows the
alert firing.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import yaml

from tests.dashboards.live import prometheus_config, start_prometheus, wait_until
from tests.dashboards.promql import RULE_FILES

pytestmark = [pytest.mark.prometheus, pytest.mark.slow, pytest.mark.timeout(240)]

GiB = 1 << 30
STEADY = 29 * GiB
FLOOR = int(2.5 * GiB)
FALL_S = 9.0
MEM_AVAILABLE = 60 * GiB
MEM_TOTAL = 120 * GiB
FALLING_WITHIN_S = 5.0   # issue 11: "must fire within 5 s of the collapse"
# The floor alert: the fall crosses 4 GiB about 8.1 s in; `for: 15s`; a second each of scrape and evaluation.
FLOOR_ALERTS_WITHIN_S = 8.1 + 15 + 3
NODE = "spark-collapse"


class CollapseSource:
    """Serves the daemon's headroom series; `collapse()` starts the fall (monotonic clock)."""

    def __init__(self) -> None:
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

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()

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


@pytest.fixture
def collapse_stack(tmp_path):
    source = CollapseSource()
    client = httpx.Client(timeout=10.0)
    config_dir = tmp_path / "prometheus"
    (config_dir / "targets").mkdir(parents=True)
    (config_dir / "targets" / "daemon.yml").write_text(
        yaml.safe_dump([{"targets": [source.address], "labels": {"node": NODE}}]))
    prometheus = None
    try:
        prometheus, api = start_prometheus(tmp_path, prometheus_config(config_dir, RULE_FILES, None), client)
        yield source, api
    except BaseException:
        if prometheus is not None:
            print(prometheus.log_tail())
        raise
    finally:
        if prometheus is not None:
            prometheus.stop()
        source.stop()
        client.close()


def _firing(api, name: str) -> list[dict]:
    return api.alerts(name, states=("firing",))


def test_the_collapse_fires_headroom_falling_within_5_s(collapse_stack):
    source, api = collapse_stack
    # A steady state first: the 8 s fit window full of 29 GiB samples, and nothing firing on it.
    wait_until("8 s of steady headroom samples in Prometheus",
               lambda: api.query('count_over_time(memtel_node_unified_headroom_bytes[8s]) >= 8'), timeout=60)
    for _ in range(4):
        assert not api.alerts("MemtelUnifiedHeadroomFalling"), "the alert is active on a steady headroom"
        time.sleep(1)

    started = source.collapse()
    seen: dict[str, float] = {}
    deadline = started + FLOOR_ALERTS_WITHIN_S + 5
    while time.monotonic() < deadline and len(seen) < 2:
        for name in ("MemtelUnifiedHeadroomFalling", "MemtelUnifiedHeadroomLow"):
            if name not in seen and _firing(api, name):
                seen[name] = time.monotonic() - started
        time.sleep(0.1)
    print("firing after the collapse began: " + ", ".join(f"{k} {v:.1f} s" for k, v in seen.items()))

    assert "MemtelUnifiedHeadroomFalling" in seen, "MemtelUnifiedHeadroomFalling never fired"
    assert seen["MemtelUnifiedHeadroomFalling"] <= FALLING_WITHIN_S, seen
    assert "MemtelUnifiedHeadroomLow" in seen and seen["MemtelUnifiedHeadroomLow"] <= FLOOR_ALERTS_WITHIN_S, seen
    (falling,) = _firing(api, "MemtelUnifiedHeadroomFalling")
    assert falling["labels"]["node"] == NODE and falling["labels"]["severity"] == "critical"
    # MemAvailable stayed at 60 GiB: the alerts that watch it alone saw nothing.
    for name in ("MemtelMemAvailableLowBytes", "MemtelMemAvailableLowShare"):
        assert not api.alerts(name), f"{name} is active although MemAvailable stayed at 60 GiB"
