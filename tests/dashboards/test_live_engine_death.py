"""MemtelEngineDiedOfMemory on a live Prometheus (issue 38): the shipped config's scrape timing (the daemon job
every second) and the shipped rules, against a daemon-shaped target whose series the test sets. A start's
NV_ERR_NO_MEMORY line with the serving process still there stays quiet; the serving process going away with
that line in the last minute fires the page within one scrape of the daemon and one evaluation."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import yaml

from tests.dashboards.live import prometheus_config, start_prometheus, wait_until
from tests.dashboards.promql import RULE_FILES

NODE = "spark-death"
ALERT = "MemtelEngineDiedOfMemory"
# The daemon's scrape (1 s), the group's evaluation (1 s), and this test's poll (0.1 s) with a little slack.
WITHIN_S = 1.0 + 1.0 + 0.5


class DaemonSeries:
    """A daemon-shaped /metrics whose values the test sets."""

    def __init__(self) -> None:
        self.values = {'memtel_process_role_processes{role="vllm"}': 1.0, "memtel_kernel_nv_err_no_memory_total": 0.0}
        series = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = "".join(f"{k} {v}\n" for k, v in series.values.items()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.slow
@pytest.mark.prometheus
def test_the_engines_death_pages_within_one_scrape_and_a_starts_line_does_not(tmp_path):
    source = DaemonSeries()
    (tmp_path / "targets").mkdir()
    (tmp_path / "targets" / "daemon-death.yml").write_text(
        yaml.safe_dump([{"targets": [source.address], "labels": {"node": NODE}}]))
    config = prometheus_config(tmp_path, RULE_FILES, None, scrape_interval=None)  # the shipped scrape intervals
    with httpx.Client(timeout=5) as client:
        process, prometheus = start_prometheus(tmp_path, config, client)
        try:
            wait_until("a minute's worth of the daemon's samples", lambda: prometheus.query(
                f'count_over_time(memtel_kernel_nv_err_no_memory_total{{node="{NODE}"}}[1m]) >= 5'), timeout=60)
            source.values["memtel_kernel_nv_err_no_memory_total"] = 1.0   # a start's line, the engine stays
            time.sleep(4)
            assert not prometheus.alerts(ALERT), "a start's NV_ERR line with the engine running paged"
            source.values['memtel_process_role_processes{role="vllm"}'] = 0.0   # the engine goes
            gone = time.monotonic()
            firing = wait_until(f"{ALERT} firing", lambda: prometheus.alerts(ALERT, states=("firing",)),
                                timeout=30, interval=0.1)
            took = time.monotonic() - gone
            print(f"{ALERT} firing {took:.1f} s after the process count fell")
            assert took <= WITHIN_S, took
            assert firing[0]["labels"]["node"] == NODE and firing[0]["labels"]["severity"] == "critical"
        finally:
            process.stop()
            source.stop()
