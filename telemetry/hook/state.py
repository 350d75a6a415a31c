"""The hook's state in one process: what the hot path and the session update, what the collector reads.

One `HookState` per process, guarded by its `lock`. The hot path (the wrapper of record.Recorder.wrap) updates a
site's `SiteStats` in place; the session sets the targets' status, the rank and whether the unresolved
check has run; the log writer counts dropped records. The collector (collector.py) reads a
`snapshot()` on every scrape. A forked child starts again from `reset_after_fork()`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import NamedTuple

from telemetry.allocator_counters import AllocatorCounters
from telemetry.hook.rank import RankInfo

MiB = 1 << 20
GiB = 1 << 30
# Per-call change of reserved bytes: 0 for most calls, else a segment's worth (2 MiB small pool,
# 20 MiB+ large pool, the logits' size for big chunks). A decrease (empty_cache, OOM-retry frees) is
# observed as 0: Prometheus histograms with negative buckets lose their _sum and _count.
RESERVED_DELTA_BUCKETS = (0, MiB, 2 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, GiB, 4 * GiB, 16 * GiB)

# A target's status: installed, pending (its module is not imported yet) or the reason it failed
# (targets.InstallError.reason: module_not_found, attribute_not_found, not_callable, patch_failed).
INSTALLED = "installed"
PENDING = "pending"
# Installed, but the loaded model has none of the layers that call it (presets.LAYERS): it never runs.
NOT_IN_MODEL = "not_in_model"

# Why a call-log record was dropped (label `reason` of memtel_hook_log_dropped_records_total).
QUEUE_FULL = "queue_full"        # the writer fell behind: the bounded queue was full
WRITE_FAILED = "write_failed"    # the write failed (a full disk, an I/O error): the record never reached the file


@dataclass(slots=True)  # slots: faster attribute updates on the hot path
class SiteStats:
    """What the hook knows about one site (hooked target) in this process."""

    calls: int = 0
    growth_events: int = 0
    allocator: AllocatorCounters | None = None   # after the site's last call
    mem_available_bytes: int | None = None
    swap_free_bytes: int | None = None
    delta_buckets: list[int] = field(default_factory=lambda: [0] * (len(RESERVED_DELTA_BUCKETS) + 1))
    delta_sum: int = 0   # the histogram's count is the sum of its buckets (one counter less per call)

    def copy(self) -> SiteStats:
        return SiteStats(self.calls, self.growth_events, self.allocator, self.mem_available_bytes,
                         self.swap_free_bytes, list(self.delta_buckets), self.delta_sum)


class StateCopy(NamedTuple):
    """A consistent copy of HookState for one scrape."""

    sites: dict[str, SiteStats]
    errors: dict[tuple[str, str], int]
    install_failures: dict[tuple[str, str], int]
    log_dropped: dict[str, int] | None   # None: no call log configured
    targets: dict[str, str]
    unresolved_checked: bool
    rank: RankInfo | None


@dataclass
class HookState:
    """All of the hook's numbers in one process; guarded by `lock`."""

    node: str
    targets: dict[str, str]      # configured target -> INSTALLED, PENDING or the failure reason
    log_configured: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    sites: dict[str, SiteStats] = field(default_factory=dict)
    calls: int = 0                                   # hooked calls recorded in this process: the next index
    previous: AllocatorCounters | None = None        # the allocator after the previous record (any site)
    errors: dict[tuple[str, str], int] = field(default_factory=dict)            # (site, stage) -> count
    install_failures: dict[tuple[str, str], int] = field(default_factory=dict)  # (target, reason) -> count
    log_dropped: dict[str, int] = field(default_factory=lambda: {QUEUE_FULL: 0, WRITE_FAILED: 0})
    rank: RankInfo | None = None                     # resolved when the process starts recording
    started: bool = False                            # rank, exporter and log are set up in this process
    unresolved_checked: bool = False

    def count_error(self, site: str, stage: str) -> None:
        with self.lock:
            self.errors[(site, stage)] = self.errors.get((site, stage), 0) + 1

    def count_install_failure(self, target: str, reason: str) -> None:
        with self.lock:
            key = (target, reason)
            self.install_failures[key] = self.install_failures.get(key, 0) + 1
            self.targets[target] = reason

    def count_log_dropped(self, reason: str, records: int) -> None:
        with self.lock:
            self.log_dropped[reason] += records

    def set_target(self, target: str, status: str) -> None:
        with self.lock:
            self.targets[target] = status

    def unresolved(self) -> dict[str, str]:
        """Configured targets that are not installed: name -> PENDING or the failure reason."""
        with self.lock:
            return {name: status for name, status in self.targets.items() if status != INSTALLED}

    def snapshot(self) -> StateCopy:
        with self.lock:
            return StateCopy({site: s.copy() for site, s in self.sites.items()}, dict(self.errors),
                            dict(self.install_failures), dict(self.log_dropped) if self.log_configured else None,
                            dict(self.targets), self.unresolved_checked, self.rank)

    def reset_after_fork(self) -> None:
        """A forked child is a new process: its own calls, rank, exporter and log (targets stay patched)."""
        self.lock = threading.Lock()
        self.sites.clear()
        self.errors.clear()
        self.log_dropped = {QUEUE_FULL: 0, WRITE_FAILED: 0}
        self.calls = 0
        self.previous = None
        self.rank = None
        self.started = False
        self.unresolved_checked = False


__all__ = ["INSTALLED", "NOT_IN_MODEL", "PENDING", "QUEUE_FULL", "RESERVED_DELTA_BUCKETS", "WRITE_FAILED", "HookState",
           "SiteStats", "StateCopy"]
