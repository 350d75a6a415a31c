"""The hot path: one record after each hooked call.

Per call: the pass-through check, one allocator read (torch's nested statistics binding), one
/proc/meminfo read through a kept-open descriptor (read and parsed in one compiled call where
built), then plain number updates under one lock and one formatted line appended to the call log's
queue. Nothing here raises into the host: every failure is counted in
`memtel_hook_errors_total{stage}`. The first record of a process has the session resolve the rank,
start the exporter and open the log (lazily: only processes that run a hooked function do this).
"""

from __future__ import annotations

import functools
from bisect import bisect_left
from collections.abc import Callable
from time import time_ns
from typing import Any

from telemetry.hook import allocator
from telemetry.hook.log_writer import CallLogWriter
from telemetry.hook.passthrough import passing_through
from telemetry.hook.state import INSTALLED, NOT_IN_MODEL, RESERVED_DELTA_BUCKETS, HookState, SiteStats
from telemetry.hook.targets import WRAPPED_ATTR, Target
from telemetry.procfs.meminfo import MeminfoReader


def shape_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int] | None:
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
    """Records hooked calls of one process into the hook's state and the call log."""

    def __init__(self, state: HookState, log: CallLogWriter | None, meminfo: MeminfoReader, *,
                 record_shape: bool, on_first_record: Callable[[], None]) -> None:
        self.state = state
        self.log = log                    # None: no call log (not configured, or refused at start)
        self.meminfo = meminfo
        self._read_meminfo = meminfo.available_and_swap_free   # bound once: an attribute lookup less per call
        self.record_shape = record_shape
        self.on_first_record = on_first_record   # the session starts this process's exporter and log
        self.enabled = True

    def baseline(self) -> None:
        """Read the allocator once now, so the first hooked call can already count as growth."""
        try:
            self.state.previous = allocator.current_reader().read()
        except Exception:
            self.state.count_error("", "allocator")

    def wrap(self, original: Callable[..., Any], target: Target) -> Callable[..., Any]:
        """The wrapper that replaces `original` (targets.apply_patch): it calls it, then records the call.

        The record is written out inside the wrapper on purpose: every Python call and attribute lookup
        here is paid per hooked call (see BENCHMARKS.md, "Hook overhead"), so what stays fixed for the
        process (the state, the meminfo read, the shape setting) is bound once as a closure variable and
        the per-site update is written out in place. `enabled` and `log` are read per call (the session
        changes them).
        """
        recorder = self
        site = target.name
        state = self.state
        read_meminfo = self._read_meminfo
        record_shape = self.record_shape
        on_first_record = self.on_first_record

        @functools.wraps(original)
        def memtel_wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            finally:
                stage = "guard"
                try:
                    if recorder.enabled and not passing_through():
                        stage = "allocator"
                        reader = allocator._reader
                        values = reader.read()
                        stage = "meminfo"
                        available, swap_free = read_meminfo()
                        ts_ns = time_ns()   # the log writes it as seconds with 9 decimals (no float repr)
                        shape = shape_of(args, kwargs) if record_shape else None
                        stage = "record"
                        lock = state.lock
                        lock.acquire()   # not `with`: half the cost of the context-manager protocol
                        try:
                            index = state.calls
                            state.calls = index + 1
                            site_stats = state.sites.get(site)
                            if site_stats is None:   # the site's first call: it runs, whatever the layer check said
                                site_stats = state.sites[site] = SiteStats()
                                if state.targets.get(site) == NOT_IN_MODEL:
                                    state.targets[site] = INSTALLED
                            site_stats.calls += 1
                            site_stats.mem_available_bytes = available
                            site_stats.swap_free_bytes = swap_free
                            if values is not None:
                                previous = state.previous
                                state.previous = site_stats.allocator = values
                                if previous is values:   # most calls: the reader handed back its unchanged counters
                                    site_stats.delta_buckets[0] += 1
                                elif previous is not None:
                                    # A growth event: num_device_alloc rose since the previous hooked call
                                    # of any target.
                                    if values.num_device_alloc > previous.num_device_alloc:
                                        site_stats.growth_events += 1
                                    delta = values.reserved_bytes - previous.reserved_bytes
                                    if delta > 0:
                                        site_stats.delta_buckets[bisect_left(RESERVED_DELTA_BUCKETS, delta)] += 1
                                        site_stats.delta_sum += delta
                                    else:   # no growth (a decrease counts as 0), no bucket search
                                        site_stats.delta_buckets[0] += 1
                        finally:
                            lock.release()
                        if not state.started:
                            on_first_record()
                        log = recorder.log
                        if log is not None:
                            stage = "jsonl"
                            log.push(ts_ns, index, site, reader.device if values is not None else "cpu", values,
                                     available, swap_free, shape)
                except Exception:   # nothing raises into the host: counted in memtel_hook_errors_total{stage}
                    state.count_error(site, stage)

        setattr(memtel_wrapper, WRAPPED_ATTR, original)
        return memtel_wrapper

    def close(self) -> None:
        self.enabled = False
