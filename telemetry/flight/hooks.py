"""The last values of the local hook exporters, for the flight recorder (optional).

The hook's exporter runs inside the serving process (one per rank, default port 9200 + local rank).
A thread scrapes each configured target once an interval with a short timeout, keeps the allocator,
host-memory and engine-start series (not histogram buckets; the daemon's protect action reads the last)
and hands the last good values to the recorder, so a
slow or dead serving process never delays a record. Everything is bounded: the response size, the
series kept per target, the number of targets (config).
"""

from __future__ import annotations

import logging
import threading
import time

from telemetry.catalogue import metrics as catalogue
from telemetry.catalogue.fields import ALLOCATOR_FAMILIES
from telemetry.flight.recorder import series_key
from telemetry.scrape import Exposition, ExpositionError, FetchError, parse, read_metrics
from telemetry.url import Endpoint, parse_url, redact_credentials

log = logging.getLogger("memtel.daemon.flight")

MAX_RESPONSE_BYTES = 1 << 20
MAX_SERIES_PER_TARGET = 256
# The hook's series the recorder keeps: the allocator's, the host memory it read, the engine's start.
KEPT = (*(entry for _, entry in ALLOCATOR_FAMILIES), catalogue.HOOK_HOST_MEM_AVAILABLE,
        catalogue.HOOK_HOST_SWAP_FREE, catalogue.ENGINE_START_REMAINING)


def kept_values(exposition: Exposition, target: str) -> dict[str, float]:
    """The kept samples of one hook exporter's exposition, labelled with `target` (its credentials, if any,
    written `***`: a record is no place for a password)."""
    target = redact_credentials(target)
    names = {name for entry in KEPT for name in entry.sample_names}
    values: dict[str, float] = {}
    for sample in exposition.samples:
        if sample.name not in names:
            continue
        if len(values) >= MAX_SERIES_PER_TARGET:
            return values
        values[series_key(sample.name, {**sample.labels, "target": target})] = sample.value
    return values


def hook_series(text: str, target: str) -> dict[str, float]:
    """The allocator, host-memory and engine-start samples of one hook exporter's /metrics text, labelled with
    `target`."""
    return kept_values(parse(text, only=KEPT), target)


def target_url(target: str) -> Endpoint:
    """`HOST:PORT` (config.py checks the form) as its /metrics URL; plain HTTP, meant for loopback. Read through
    telemetry/scrape: no proxy from the environment (http_proxy would route a loopback scrape elsewhere), no
    redirect followed by a root daemon."""
    return parse_url(target, "flight.hook_targets")


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
                exposition = read_metrics(target_url(target), time.monotonic() + self.timeout_seconds,
                                          MAX_RESPONSE_BYTES, only=KEPT)
                values = kept_values(exposition, target)
            except (FetchError, ExpositionError, ValueError) as exc:
                with self._lock:
                    self._last.pop(target, None)  # a dead exporter leaves no stale values in the records
                if target not in self._failing:
                    self._failing.add(target)
                    log.info("flight recorder: hook exporter %s not readable (%s); retrying",
                             redact_credentials(target), redact_credentials(str(exc)))
                continue
            if target in self._failing:
                self._failing.discard(target)
                log.info("flight recorder: hook exporter %s readable again", redact_credentials(target))
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
