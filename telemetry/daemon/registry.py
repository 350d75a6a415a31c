"""The daemon's collectors: where each registers itself, and the wrapper that runs them on every scrape.

Registration (as node_exporter's collectors do it): each collector module under
telemetry/daemon/collectors/ declares itself with `@register(NAME, order=..., help=...)` on the function
that builds it from the daemon's config. `telemetry.daemon.collectors` imports every module of its
folder, so the flags (`--disable-collector`, `--enable-collector`), the config's `collectors.disabled`
and the docs table (docs/metrics.md, checked by a test) all come from these registrations.

Running: a collector is any object with `collect()` returning metric families. The wrapper runs every
collector of a scrape side by side, each in a worker thread, and waits for each at most
`deadline_seconds` from the start of the scrape: a collector that hangs (an NVML call that never
returns) costs only its own series, `memtel_collector_success{collector}` is 0 and the scrape answers.
A collector whose last call has not returned is not called again; the next scrape waits on that same
call (so a hung collector holds one thread, never more). If a collector raises, its families are left
out of that scrape (never zeroed) and its success is 0. A collector that is "unavailable" in a normal
way (no NVML on a CPU box) raises `CollectorUnavailable` and may still hand over a few families that
say so (`memtel_gpu_nvml_available 0`). Errors are logged once per distinct message, and once more
when the collector recovers.
"""

from __future__ import annotations

import functools
import logging
import platform
import queue
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from prometheus_client.core import Metric

from telemetry.catalogue import described
from telemetry.catalogue import metrics as catalogue
from telemetry.version import __version__

if TYPE_CHECKING:
    from telemetry.daemon.settings import DaemonConfig

log = logging.getLogger("memtel.daemon")

DEFAULT_DEADLINE_SECONDS = 2.0
"""How long a scrape waits for one collector (a collector reads a few /proc files: milliseconds)."""


class Collector(Protocol):
    def collect(self) -> Iterable[Metric]: ...


@runtime_checkable
class BackgroundCollector(Collector, Protocol):
    """A collector with a reader of its own (the kernel log's follower): started after the state directory is
    made safe, stopped when the daemon stops."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


class CollectorUnavailable(Exception):
    """The source is not there (a normal state); `families` are still exported."""

    def __init__(self, message: str, families: Iterable[Metric] = ()) -> None:
        super().__init__(message)
        self.families = list(families)


# -- registration -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CollectorSpec:
    """One registered collector: its name (the `collector` label), its place in the scrape, one line of help
    (the flags' help and the docs table), and how to build it from the daemon's config. A built collector
    may have `start()` and `stop()` (a background reader); `uses_state_dir`: it keeps state in STATE_DIR."""

    name: str
    order: int
    help: str
    build: Callable[[DaemonConfig], Collector]
    default_enabled: bool = True
    uses_state_dir: bool = False


_SPECS: dict[str, CollectorSpec] = {}


def register(name: str, *, order: int, help: str, default_enabled: bool = True,
             uses_state_dir: bool = False) -> Callable[[Callable[[DaemonConfig], Collector]],
                                                       Callable[[DaemonConfig], Collector]]:
    """Decorates a collector module's `build(config)`: registers the collector under `name`."""

    def decorate(build: Callable[[DaemonConfig], Collector]) -> Callable[[DaemonConfig], Collector]:
        if name in _SPECS:
            raise ValueError(f"collector {name!r} is registered twice")
        _SPECS[name] = CollectorSpec(name, order, help, build, default_enabled, uses_state_dir)
        return build

    return decorate


def registered() -> tuple[CollectorSpec, ...]:
    """Every registered collector in scrape order (import telemetry.daemon.collectors first: it loads them)."""
    return tuple(sorted(_SPECS.values(), key=lambda spec: (spec.order, spec.name)))


# -- running ----------------------------------------------------------------------------------------
class _Call:
    """One call of one collector's collect(), run by a worker thread."""

    __slots__ = ("done", "elapsed", "error", "families")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.families: list[Metric] = []
        self.error: BaseException | None = None
        self.elapsed = 0.0

    def run(self, collector: Collector) -> None:
        started = time.perf_counter()
        try:
            self.families = list(collector.collect())
        except BaseException as exc:  # kept for the scrape that waits on it; a worker never dies of a collector
            self.error = exc
        self.elapsed = time.perf_counter() - started
        self.done.set()


class _Workers:
    """Daemon threads that run collector calls: at most `limit`, started when none is idle, ended after a
    minute idle. Daemon threads, so a call that never returns cannot hold the process at exit (SIGTERM)."""

    IDLE_SECONDS = 60.0

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # one permit per worker waiting for a task
        self._lock = threading.Lock()
        self._threads = 0

    def submit(self, task: Callable[[], None]) -> None:
        self._tasks.put(task)
        if self._idle.acquire(blocking=False):
            return  # a waiting worker takes it
        with self._lock:
            if self._threads < self.limit:
                self._threads += 1
                threading.Thread(target=self._work, name=f"memtel-collector-{self._threads}", daemon=True).start()

    def _work(self) -> None:
        while True:
            try:
                task = self._tasks.get(timeout=self.IDLE_SECONDS)
            except queue.Empty:
                if self._idle.acquire(blocking=False):  # no task is promised to this worker: end it
                    with self._lock:
                        if self._tasks.empty():  # (a task that came meanwhile found no idle worker: run it)
                            self._threads -= 1
                            return
                continue
            task()
            self._idle.release()


class DaemonCollectors:
    """Registered once in a CollectorRegistry; yields every collector's families plus health series."""

    def __init__(self, collectors: dict[str, Collector], *, start_time: float | None = None,
                 deadline_seconds: float = DEFAULT_DEADLINE_SECONDS) -> None:
        self.collectors = collectors
        self.start_time = time.time() if start_time is None else start_time
        self.deadline_seconds = deadline_seconds
        self.scrapes = 0
        self.last_success: dict[str, bool] = {}
        self._failures: dict[str, int] = {name: 0 for name in collectors}
        self._last_error: dict[str, str] = {}
        self._lock = threading.Lock()  # guards the counters and the calls in flight below
        self._in_flight: dict[str, _Call] = {}
        # One worker per collector at most: a hung collector holds one, and is not called again while it does.
        self._workers = _Workers(max(1, len(collectors)))
        # The last scrape's families: (monotonic time, Unix time, families) of when it began. The flight
        # recorder records them instead of collecting again when they are fresh (a 1 s scrape).
        self.last_scrape: tuple[float, float, list[Metric]] | None = None

    def describe(self) -> list[Metric]:
        """Every family the collectors given (by their registered names, the catalogue's `source`) and the health
        series can export, from the catalogue: registering never collects, and a duplicate name is refused."""
        return described("daemon", *self.collectors)

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
        deadline = time.monotonic() + self.deadline_seconds
        calls = [(name, self._start(name, collector)) for name, collector in self.collectors.items()
                 if name not in skip]
        success, duration, failures = (catalogue.COLLECTOR_SUCCESS.new(), catalogue.COLLECTOR_DURATION.new(),
                                       catalogue.COLLECTOR_FAILURES.new())
        collected: list[Metric] = []
        for name, call in calls:
            finished = call.done.wait(max(0.0, deadline - time.monotonic()))
            ok, families = self._outcome(name, call) if finished else self._timed_out(name)
            collected.extend(families)
            success.add_metric([name], 1.0 if ok else 0.0)
            duration.add_metric([name], call.elapsed if finished else self.deadline_seconds)
            failures.add_metric([name], self._failures[name])
        return [*collected, success, duration, failures]

    def _start(self, name: str, collector: Collector) -> _Call:
        """The collector's call in flight, or a new one."""
        with self._lock:
            call = self._in_flight.get(name)
            if call is None or call.done.is_set():
                call = self._in_flight[name] = _Call()
                self._workers.submit(functools.partial(call.run, collector))
            return call

    def _timed_out(self, name: str) -> tuple[bool, list[Metric]]:
        self._note_failure(name, f"did not answer within {self.deadline_seconds:g} s (still running; not called "
                                 "again until it returns)", level=logging.WARNING)
        return False, []

    def _outcome(self, name: str, call: _Call) -> tuple[bool, list[Metric]]:
        exc = call.error
        if isinstance(exc, CollectorUnavailable):
            self._note_failure(name, str(exc), level=logging.INFO)
            return False, exc.families
        if exc is not None:  # a broken collector must never break the scrape
            self._note_failure(name, f"{type(exc).__name__}: {exc}", level=logging.WARNING)
            return False, []
        if self.last_success.get(name) is False:
            log.info("collector %s works again", name)
        self.last_success[name] = True
        self._last_error.pop(name, None)
        return True, call.families

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
        build = catalogue.EXPORTER_BUILD_INFO.new()
        build.add_metric([__version__, platform.python_version()], 1.0)
        yield build
        yield catalogue.EXPORTER_START_TIME.new(self.start_time)
        yield catalogue.EXPORTER_SCRAPES.new(scrapes)
