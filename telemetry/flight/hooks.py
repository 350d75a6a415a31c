"""The last values of the local hook exporters, for the flight recorder (optional).

The hook's exporter runs inside the serving process (one per rank, default port 9200 + local rank).
A thread scrapes each configured target once an interval with a short timeout, keeps the allocator,
host-memory and engine-start series (not histogram buckets; the daemon's protect action reads the last)
and hands the last good values to the recorder, so a
slow or dead serving process never delays a record. Everything is bounded: the response size, the
series kept per target, the number of targets (config).
"""

from __future__ import annotations

import http.client
import logging
import threading
import urllib.error
import urllib.request
from typing import IO

from prometheus_client.parser import text_string_to_metric_families

from telemetry.flight.recorder import series_key

log = logging.getLogger("memtel.daemon.flight")

MAX_RESPONSE_BYTES = 1 << 20
MAX_SERIES_PER_TARGET = 256
KEPT_PREFIXES = ("memtel_allocator_", "memtel_hook_host_", "memtel_engine_start_")
_SKIPPED_SUFFIXES = ("_bucket", "_created")


def hook_series(text: str, target: str) -> dict[str, float]:
    """The allocator, host-memory and engine-start samples of one hook exporter's /metrics text, labelled with
    `target`."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(KEPT_PREFIXES) or sample.name.endswith(_SKIPPED_SUFFIXES):
                continue
            if len(values) >= MAX_SERIES_PER_TARGET:
                return values
            values[series_key(sample.name, {**sample.labels, "target": target})] = float(sample.value)
    return values


def target_url(target: str) -> str:
    """`HOST:PORT` (config.py checks the form) as its /metrics URL; plain HTTP, meant for loopback."""
    return f"http://{target}/metrics"


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str,
                         headers: http.client.HTTPMessage, newurl: str) -> None:
        return None  # a root daemon follows no redirect to elsewhere


# No proxy from the environment (http_proxy would route a loopback scrape elsewhere) and no redirects.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirects())


class HookScraper:
    def __init__(self, targets: tuple[str, ...], interval_seconds: float = 1.0, timeout_seconds: float = 0.5) -> None:
        self.targets = targets
        self.interval_seconds = interval_seconds
        self.timeout_seconds = timeout_seconds
        self._last: dict[str, dict[str, float]] = {}
        self._failing: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def scrape_once(self) -> None:
        for target in self.targets:
            try:
                with _OPENER.open(target_url(target), timeout=self.timeout_seconds) as response:
                    body = response.read(MAX_RESPONSE_BYTES + 1)
                if len(body) > MAX_RESPONSE_BYTES:
                    raise ValueError(f"response larger than {MAX_RESPONSE_BYTES} bytes")
                values = hook_series(body.decode("utf-8", "replace"), target)
            except (OSError, ValueError, urllib.error.URLError) as exc:
                with self._lock:
                    self._last.pop(target, None)  # a dead exporter leaves no stale values in the records
                if target not in self._failing:
                    self._failing.add(target)
                    log.info("flight recorder: hook exporter %s not readable (%s); retrying", target, exc)
                continue
            if target in self._failing:
                self._failing.discard(target)
                log.info("flight recorder: hook exporter %s readable again", target)
            with self._lock:
                self._last[target] = values

    def latest(self) -> dict[str, float]:
        with self._lock:
            merged: dict[str, float] = {}
            for values in self._last.values():
                merged.update(values)
            return merged

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="memtel-flight-hooks", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.scrape_once()
            except Exception:
                log.exception("flight recorder: scraping hook exporters failed")
            self._stop.wait(self.interval_seconds)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
