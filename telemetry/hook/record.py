"""The hot path: one record after each hooked call.

Per call: the pass-through check, one allocator read (torch's nested statistics binding), one
/proc/meminfo read through a kept-open descriptor (read and parsed in one compiled call where
built), then plain number updates under one lock and one formatted line appended to the JSONL
queue. Nothing here raises into the host: every failure is counted in
`memtel_hook_errors_total{stage}`. The first record of a process resolves the rank, starts the
exporter and opens the log (lazily: only processes that run a hooked function do any of this).
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
from bisect import bisect_left
from collections.abc import Callable
from time import time_ns
from typing import Any

from telemetry.hook import allocator, guards
from telemetry.hook.guards import passing_through
from telemetry.hook.jsonl_sink import JsonlSink
from telemetry.hook.prometheus_sink import RESERVED_DELTA_BUCKETS, Exporter, HookStats, SiteStats
from telemetry.hook.rank import RankInfo, resolve_rank
from telemetry.hook.targets import WRAPPED_ATTR
from telemetry.procfs.meminfo import MeminfoReader

log = logging.getLogger("memtel.hook")


def shape_of(args: tuple, kwargs: dict) -> list | None:
    """[rows, cols] of the first tensor-like argument (a tuple's first item counts: (q, scale))."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, tuple) and value:
            value = value[0]
        shape = getattr(value, "shape", None)
        if shape is not None and not isinstance(value, type):
            dims = list(shape)
            if not dims:
                continue
            rows = int(dims[0])
            cols = 1
            for d in dims[1:]:
                cols *= int(d)
            return [rows, cols]
    return None


class Recorder:
    """Records hooked calls of one process into the Prometheus state and the JSONL log."""

    def __init__(self, *, exporter: Exporter | None, jsonl: JsonlSink | None, stats: HookStats,
                 record_shape: bool = False, node: str | None = None,
                 meminfo: MeminfoReader | None = None,
                 on_first_record: Callable[[], None] = lambda: None) -> None:
        self.exporter = exporter
        self.jsonl = jsonl
        self.stats = stats
        self.record_shape = record_shape
        self.node = node or socket.gethostname()
        self.meminfo = meminfo or MeminfoReader()
        self.on_first_record = on_first_record
        self.enabled = True
        self.rank: RankInfo | None = None
        self.calls = 0
        self._previous: tuple | None = None   # allocator values after the previous record
        self._started = False
        self._start_lock = threading.Lock()
        if jsonl is not None:
            stats.dropped_records = lambda: self.jsonl.dropped if self.jsonl is not None else 0

    def baseline(self) -> None:
        """Read the allocator once now, so the first hooked call can already count as growth."""
        try:
            self._previous = allocator.current_reader().read()
        except Exception:
            self.stats.count_error("", "allocator")

    def record(self, site: str, args: tuple, kwargs: dict) -> None:
        # One function on purpose: every Python call and attribute lookup here is paid per hooked
        # call (see BENCHMARKS.md, "Hook overhead"), so the per-site update is written out in place.
        if not self.enabled:
            return
        stage = "guard"
        try:
            if passing_through():
                return
            stage = "allocator"
            reader = allocator._reader
            values = reader.read()
            stage = "meminfo"
            available, swap_free = self.meminfo.available_and_swap_free()
            ts_ns = time_ns()   # the log writes it as seconds with 9 decimals (no float repr)
            shape = shape_of(args, kwargs) if self.record_shape else None
            stage = "record"
            stats = self.stats
            lock = stats.lock
            lock.acquire()   # not `with`: half the cost of the context-manager protocol
            try:
                index = self.calls
                self.calls = index + 1
                site_stats = stats.sites.get(site)
                if site_stats is None:
                    site_stats = stats.sites[site] = SiteStats()
                site_stats.calls += 1
                site_stats.mem_available_bytes = available
                site_stats.swap_free_bytes = swap_free
                if values is not None:
                    previous = self._previous
                    self._previous = site_stats.allocator = values
                    if previous is not None:
                        if values[2] > previous[2]:   # num_device_alloc rose: a new segment
                            site_stats.growth_events += 1
                        delta = values[0] - previous[0]
                        if delta > 0:
                            site_stats.delta_buckets[bisect_left(RESERVED_DELTA_BUCKETS, delta)] += 1
                            site_stats.delta_sum += delta
                        else:   # most calls: no growth (a decrease counts as 0), no bucket search
                            site_stats.delta_buckets[0] += 1
            finally:
                lock.release()
            if not self._started:
                self._start()
            jsonl = self.jsonl
            if jsonl is not None:
                stage = "jsonl"
                jsonl.push(ts_ns, index, site, reader.device if values is not None else "cpu", values,
                           available, swap_free, shape)
        except Exception:
            self.stats.count_error(site, stage)

    def _start(self) -> None:
        """First record of this process: rank, exporter, log file."""
        with self._start_lock:
            if self._started:
                return
            self._started = True
            self.rank = resolve_rank()
            if self.jsonl is not None:
                self.jsonl.open(self.rank.rank)
            if self.exporter is not None:
                try:
                    self.exporter.start(self.rank.local_rank)
                except OSError as error:  # a taken port must not stop the log or the host
                    log.warning("memtel: hook exporter not started on port %s + local rank %d: %s",
                                self.exporter.base_port, self.rank.local_rank, error)
                    self.stats.count_error("", "exporter")
            self.on_first_record()

    def labels(self) -> tuple[str, str]:
        rank = self.rank if self.rank is not None else resolve_rank()
        return str(rank.rank), self.node

    def reset_after_fork(self) -> None:
        """A forked child is a new process: its own calls, rank, exporter and log."""
        self.stats.lock = threading.Lock()
        self.stats.sites.clear()
        self.stats.errors.clear()
        self._start_lock = threading.Lock()
        self.calls = 0
        self.rank = None
        self._started = False
        self._previous = None
        allocator.current_reader().reset()
        guards.reset()   # (the meminfo descriptor is dropped by procfile's own at-fork handler)
        if self.exporter is not None:
            self.exporter.reset_after_fork()
        if self.jsonl is not None:
            self.jsonl.reset_after_fork()

    def close(self) -> None:
        self.enabled = False
        if self.jsonl is not None:
            self.jsonl.close()
        if self.exporter is not None:
            self.exporter.stop()


def make_wrapper(record: Callable[[str, tuple, dict], None]) -> Callable[[Callable, Any], Callable]:
    """A factory for targets.apply_patch: the wrapper calls the original, then records."""

    def wrap(original: Callable, target) -> Callable:
        site = target.name

        @functools.wraps(original)
        def memtel_wrapper(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            finally:
                record(site, args, kwargs)

        setattr(memtel_wrapper, WRAPPED_ATTR, original)
        return memtel_wrapper

    return wrap
