"""One wrapper that runs every collector on each scrape, times it and reports its success.

A collector is any object with `collect()` returning metric families. If it raises, its families
are left out of that scrape (never zeroed) and `memtel_collector_success{collector}` is 0. A
collector that is "unavailable" in a normal way (no NVML on a CPU box) raises `CollectorUnavailable`
and may still hand over a few families that say so (`memtel_gpu_nvml_available 0`).
Errors are logged once per distinct message, and once more when the collector recovers.
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from collections.abc import Collection, Iterable, Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from telemetry import __version__

log = logging.getLogger("memtel.daemon")


class Collector(Protocol):
    def collect(self) -> Iterable[Metric]: ...


class CollectorUnavailable(Exception):
    """The source is not there (a normal state); `families` are still exported."""

    def __init__(self, message: str, families: Iterable[Metric] = ()) -> None:
        super().__init__(message)
        self.families = list(families)


class DaemonCollectors:
    """Registered once in a CollectorRegistry; yields every collector's families plus health series."""

    def __init__(self, collectors: dict[str, Collector], *, start_time: float | None = None) -> None:
        self.collectors = collectors
        self.start_time = time.time() if start_time is None else start_time
        self.scrapes = 0
        self.last_success: dict[str, bool] = {}
        self._failures: dict[str, int] = {name: 0 for name in collectors}
        self._last_error: dict[str, str] = {}
        self._lock = threading.Lock()  # guards the counters below
        # Scrapes may overlap (one thread per connection); collectors keep small caches, so one at a time.
        self._collect_lock = threading.Lock()
        # The last scrape's families: (monotonic time, Unix time, families) of when it began. The flight
        # recorder records them instead of collecting again when they are fresh (a 1 s scrape).
        self.last_scrape: tuple[float, float, list[Metric]] | None = None

    def describe(self) -> list[Metric]:
        return []  # families vary per scrape; an empty describe keeps registration from collecting

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            self.scrapes += 1
            scrapes = self.scrapes
        started = (time.monotonic(), time.time())
        families = self.collect_sources()
        self.last_scrape = (*started, families)
        yield from families
        yield from self._self_health(scrapes)

    def collect_sources(self, skip: Collection[str] = ()) -> list[Metric]:
        """Every collector's families (except those named in `skip`) and the health families, without
        counting a scrape: the flight recorder samples the node through this once a second."""
        success = GaugeMetricFamily(
            "memtel_collector_success", "1 if the collector succeeded during this scrape, else 0.", labels=["collector"]
        )
        duration = GaugeMetricFamily(
            "memtel_collector_duration_seconds", "Time the collector took during this scrape.", labels=["collector"]
        )
        failures = CounterMetricFamily(
            "memtel_collector_failures", "Failed collections since the daemon started.", labels=["collector"]
        )
        collected: list[Metric] = []
        with self._collect_lock:
            for name, collector in self.collectors.items():
                if name in skip:
                    continue
                started = time.perf_counter()
                ok, families = self._run_one(name, collector)
                elapsed = time.perf_counter() - started
                collected.extend(families)
                success.add_metric([name], 1.0 if ok else 0.0)
                duration.add_metric([name], elapsed)
                failures.add_metric([name], self._failures[name])
        return [*collected, success, duration, failures]

    def _run_one(self, name: str, collector: Collector) -> tuple[bool, list[Metric]]:
        try:
            families = list(collector.collect())
        except CollectorUnavailable as exc:
            self._note_failure(name, str(exc), level=logging.INFO)
            return False, exc.families
        except Exception as exc:  # a broken collector must never break the scrape
            self._note_failure(name, f"{type(exc).__name__}: {exc}", level=logging.WARNING)
            return False, []
        if self.last_success.get(name) is False:
            log.info("collector %s works again", name)
        self.last_success[name] = True
        self._last_error.pop(name, None)
        return True, families

    def _note_failure(self, name: str, message: str, level: int) -> None:
        with self._lock:
            self._failures[name] += 1
        self.last_success[name] = False
        if self._last_error.get(name) != message:
            self._last_error[name] = message
            log.log(level, "collector %s failed: %s", name, message)

    def health(self) -> dict[str, object]:
        """For /healthz: last known state of each collector, without collecting."""
        return {
            "status": "ok",
            "scrapes": self.scrapes,
            "collectors": {
                name: {"success": self.last_success.get(name), "error": self._last_error.get(name)}
                for name in self.collectors
            },
        }

    def _self_health(self, scrapes: int) -> Iterator[Metric]:
        build = GaugeMetricFamily(
            "memtel_exporter_build_info", "memtel version and Python version of the daemon (always 1).",
            labels=["version", "python"],
        )
        build.add_metric([__version__, platform.python_version()], 1.0)
        yield build
        yield GaugeMetricFamily(
            "memtel_exporter_start_time_seconds", "Unix time the daemon started.", value=self.start_time
        )
        yield CounterMetricFamily(
            "memtel_exporter_scrapes", "Scrapes of /metrics served since the daemon started.", value=scrapes
        )
