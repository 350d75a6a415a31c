"""The node's unified-memory headroom: how much a GPU on unified memory could still get, from procfs figures.

    headroom = min(MemAvailable, free_contiguous + success_ratio × (MemAvailable − free_contiguous))

- `free_contiguous`: free memory in blocks of at least 2 MiB (/proc/buddyinfo): what a large-page
  allocation gets now, without reclaim or compaction.
- `MemAvailable − free_contiguous`: what the kernel says it can give back (page cache, reclaimable slab,
  small free blocks), but only in 2 MiB blocks after reclaiming and compacting it.
- `success_ratio`: of the page faults of the last `WINDOW_SECONDS` that asked for a transparent huge page
  (/proc/vmstat thp_fault_alloc and thp_fault_fallback), the share that got one. With THP `madvise` and
  defrag `madvise` (the Debian/Ubuntu default), such a fault reclaims and compacts before it falls back, so
  the share is what the kernel could really turn into 2 MiB blocks. None (counted as 1: no evidence that
  it fails) with fewer than `MIN_FAULTS` faults, or where faults fall back without trying (THP `always`
  with a defrag setting other than `always`: `thp_faults_compact`).

Direct-compaction counters (compact_success, compact_fail) are exported but not used: on this machine a
14 GiB huge-page allocation into a full page cache got 93 % huge pages while compaction failed 2,405 times
out of 2,775 (it fails while free memory is short, then reclaim frees some and the fault succeeds);
BENCHMARKS.md, "Headroom: what a large-page allocation really gets".

A healthy node with a full page cache reads MemAvailable; a fragmented node whose huge-page faults fall back
reads close to its free contiguous memory; a collapse reads low because MemAvailable itself falls. The old
figure, min(MemAvailable, free_contiguous), is kept as `headroom_without_reclaim`. docs/metrics.md argues it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from telemetry.procfs.buddyinfo import (
    BUDDYINFO_PATH,
    CONTIGUOUS_BLOCK_BYTES,
    free_bytes_in_blocks_of_at_least,
    read_free_blocks,
    system_page_size,
)
from telemetry.procfs.meminfo import MEMINFO_PATH, MeminfoReader
from telemetry.procfs.procfile import ProcFile
from telemetry.procfs.vmstat import VMSTAT_PATH, parse_vmstat

WINDOW_SECONDS = 300.0
MIN_FAULTS = 8  # fewer huge-page faults in the window than this: no evidence
FAULT_FIELDS = ("thp_fault_alloc", "thp_fault_fallback")
THP_SYSFS = "/sys/kernel/mm/transparent_hugepage"


def headroom_without_reclaim(mem_available: int, free_contiguous: int) -> int:
    """The old definition: what a large-page allocation gets without reclaim or compaction."""
    return min(mem_available, free_contiguous)


def success_share(success_ratio: float | None) -> float:
    """The huge-page faults' success ratio as the headroom counts it: within 0 and 1, None (no evidence) as 1."""
    return 1.0 if success_ratio is None else min(max(success_ratio, 0.0), 1.0)


def unified_headroom(mem_available: int, free_contiguous: int, success_ratio: float | None) -> int:
    """The headroom (module docstring); `success_ratio` None means no evidence, counted as 1."""
    reclaimable = max(mem_available - free_contiguous, 0)
    return min(mem_available, free_contiguous + int(success_share(success_ratio) * reclaimable))


def headroom_taken(remaining: float, without_reclaim: float, success_ratio: float | None) -> float:
    """What taking `remaining` more bytes of MemAvailable takes from the headroom, by the headroom's definition
    (issue 38): the free 2 MiB blocks (`without_reclaim`, headroom_without_reclaim) go first, byte for byte; the
    rest comes out of what reclaim and compaction give back, which the headroom counts at the success ratio. So
    the headroom less this is unified_headroom(MemAvailable - remaining, max(free_contiguous - remaining, 0),
    success_ratio): where the node ends once a start takes `remaining`, on the same measure as the headroom.
    Without the discount a start that takes the node's page cache looks (1 - ratio) x that much larger than the
    fall it causes."""
    beyond_free = max(remaining - max(without_reclaim, 0.0), 0.0)
    return remaining - (1.0 - success_share(success_ratio)) * beyond_free


def selected(sysfs_text: str) -> str:
    """The bracketed choice of a THP sysfs file: "always [madvise] never" -> "madvise"."""
    start, end = sysfs_text.find("["), sysfs_text.find("]")
    return sysfs_text[start + 1:end] if 0 <= start < end else sysfs_text.strip()


def thp_faults_compact(enabled: str, defrag: str) -> bool:
    """Whether a huge-page fault that falls back first tried reclaim and compaction (mm/huge_memory.c,
    vma_thp_gfp_mask): always with defrag `always`; only in MADV_HUGEPAGE regions with `madvise` or
    `defer+madvise`. With THP `always` and another defrag, most faults are in regions that never compact, so
    their fallbacks say nothing about what compaction could do."""
    if enabled == "madvise":
        return defrag in ("always", "madvise", "defer+madvise")
    if enabled == "always":
        return defrag == "always"
    return False


def read_thp_mode(sysfs: str = THP_SYSFS) -> tuple[str, str] | None:
    try:
        with open(f"{sysfs}/enabled") as enabled, open(f"{sysfs}/defrag") as defrag:
            return selected(enabled.read()), selected(defrag.read())
    except OSError:
        return None


@dataclass(frozen=True)
class FaultOutcomes:
    """Huge-page faults over a window: those that got a huge page, those that fell back, the window's length."""

    alloc: int
    fallback: int
    seconds: float

    @property
    def success_ratio(self) -> float | None:
        total = self.alloc + self.fallback
        return self.alloc / total if total >= MIN_FAULTS else None


class FaultWindow:
    """Keeps (time, thp_fault_alloc, thp_fault_fallback) samples and gives the outcomes of the last window.

    The one piece of state of the headroom: a sample per collection, pruned to the window. A counter that
    went backwards (a replaced /proc fixture; kernel counters only grow) restarts the window.
    """

    def __init__(self, window_seconds: float = WINDOW_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_seconds = window_seconds
        self.clock = clock
        self.samples: deque[tuple[float, int, int]] = deque()

    def add(self, vmstat: Mapping[str, int]) -> FaultOutcomes | None:
        """Record the counters now; the outcomes since the oldest sample of the window (None without the
        counters: a kernel without CONFIG_TRANSPARENT_HUGEPAGE prints none)."""
        if not all(name in vmstat for name in FAULT_FIELDS):
            return None
        now = self.clock()
        alloc, fallback = vmstat["thp_fault_alloc"], vmstat["thp_fault_fallback"]
        if self.samples and (alloc < self.samples[-1][1] or fallback < self.samples[-1][2]):
            self.samples.clear()
        self.samples.append((now, alloc, fallback))
        # Keep one sample at or before the window's start, so the window is covered in full.
        while len(self.samples) > 1 and self.samples[1][0] <= now - self.window_seconds:
            self.samples.popleft()
        first = self.samples[0]
        return FaultOutcomes(alloc - first[1], fallback - first[2], now - first[0])


@dataclass(frozen=True)
class HeadroomReading:
    """The node's headroom figures at one read: `headroom` (unified_headroom), `without_reclaim`
    (headroom_without_reclaim) and the huge-page faults' `success_ratio` (None: no evidence)."""

    headroom: int
    without_reclaim: int
    success_ratio: float | None


class HeadroomReader:
    """Reads the node's headroom now from meminfo, buddyinfo and vmstat: the one reading the daemon's headroom
    collector exports and its protect loop acts on. Keeps the fault window (its one piece of state); reads the THP
    mode once, here. `read()` raises OSError or ValueError where a file cannot be read or is not what it should
    be (a kernel before 3.14 has no MemAvailable)."""

    def __init__(self, meminfo_path: str = MEMINFO_PATH, buddyinfo_path: str = BUDDYINFO_PATH,
                 page_size: int | None = None, vmstat_path: str = VMSTAT_PATH,
                 window: FaultWindow | None = None, thp_sysfs: str = THP_SYSFS) -> None:
        self.meminfo = MeminfoReader(meminfo_path)
        self.buddyinfo = ProcFile(buddyinfo_path)
        self.vmstat = ProcFile(vmstat_path)
        self.page_size = page_size or system_page_size()
        self.window = window or FaultWindow()
        mode = read_thp_mode(thp_sysfs)
        # Without THP, or where faults fall back without compacting, there is no evidence either way.
        self.faults_are_evidence = mode is not None and thp_faults_compact(*mode)

    def read(self) -> HeadroomReading:
        available, _ = self.meminfo.available_and_swap_free()  # the hook's fast read of the one field needed
        if available is None:
            raise ValueError(f"{self.meminfo.path} has no MemAvailable line (kernels before 3.14 lack it)")
        contiguous = free_bytes_in_blocks_of_at_least(read_free_blocks(self.buddyinfo), CONTIGUOUS_BLOCK_BYTES,
                                                      self.page_size)
        vmstat = parse_vmstat(self.vmstat.read_text())
        if not vmstat:
            raise ValueError(f"{self.vmstat.path} has no `name value` lines: not a vmstat file")
        outcomes = self.window.add(vmstat)
        ratio = outcomes.success_ratio if outcomes is not None and self.faults_are_evidence else None
        return HeadroomReading(unified_headroom(available, contiguous, ratio),
                               headroom_without_reclaim(available, contiguous), ratio)


# -- "falling": one definition for MemtelUnifiedHeadroomFalling and the daemon's protect action ----------------
@dataclass(frozen=True)
class FallingRule:
    """The headroom is falling for real when, over the last `window_seconds` (at least `min_samples` samples):

    1. floor: the headroom now is below `floor_ratio` of MemTotal (a large allocation that leaves a quarter of
       the node free is a model or KV-cache load, not a collapse);
    2. rate: the least-squares slope of the headroom is steeper than `rate_bytes_per_second` downward;
    3. drop: the headroom fell by at least `min_drop_bytes` from the window's highest sample (a real fall in
       bytes, not a 1-2 GiB wobble);

    unless the node's starting engines explain it (issue 29). An engine that starts exports what its start
    will still take (memtel_engine_start_remaining_bytes, read by its hook; counted as 0 for window_seconds
    after its start ended, so the tail of its own fall stays explained). What it will still take is measured as
    the headroom is (`headroom_taken`: the free 2 MiB blocks byte for byte, the rest at the huge-page faults'
    success ratio, issue 38). Per engine, the headroom less what it will still take, at its highest over the
    last `start_lag_seconds` (the hook's scrape interval: a reading that lags the daemon's by one scrape is not
    a fall), is where the node ends once that start is done; over
    the engines, the node ends at the sum of those less (engines - 1) × the headroom now. The fall is
    explained when that is at least `low_floor_bytes`, MemtelUnifiedHeadroomLow's floor. A start that asks
    for more than the node has begins below it; a collapse during a start takes it below the floor as it
    happens (seen up to start_lag_seconds later than without a start); a node without a hook has no start.

    dashboards/prometheus/memtel-alerts.yml writes the same numbers as recording rules
    (memtel:unified_headroom_falling_*, memtel:unified_headroom_low_threshold_bytes);
    tests/alerts/test_falling_definition.py holds the two together.
    """

    window_seconds: float = 8.0
    min_samples: int = 6
    floor_ratio: float = 0.25
    rate_bytes_per_second: float = 0.5 * 1024**3
    min_drop_bytes: float = 4 * 1024**3
    low_floor_bytes: float = 4 * 1024**3
    start_lag_seconds: float = 5.0


FALLING = FallingRule()


@dataclass(frozen=True)
class FallingEvidence:
    headroom_bytes: float
    mem_total_bytes: float
    slope_bytes_per_second: float | None
    drop_bytes: float
    samples: int
    # Where the node ends once its starting engines hold what they plan (FallingRule); None: no engine started
    # within the window.
    after_starts_bytes: float | None = None

    def explained_by_starts(self, rule: FallingRule = FALLING) -> bool:
        return self.after_starts_bytes is not None and self.after_starts_bytes >= rule.low_floor_bytes

    def is_falling(self, rule: FallingRule = FALLING) -> bool:
        return (self.samples >= rule.min_samples and self.slope_bytes_per_second is not None
                and self.headroom_bytes < rule.floor_ratio * self.mem_total_bytes
                and self.slope_bytes_per_second < -rule.rate_bytes_per_second
                and self.drop_bytes >= rule.min_drop_bytes
                and not self.explained_by_starts(rule))


def least_squares_slope(points: list[tuple[float, float]]) -> float | None:
    """Slope of the least-squares line through (time, value) points, as PromQL's deriv() fits it."""
    if len(points) < 2:
        return None
    mean_t = sum(t for t, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread == 0:
        return None
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / spread


def falling_evidence(samples: list[tuple[float, float]], mem_total_bytes: float,
                     rule: FallingRule = FALLING,
                     start_remaining: Sequence[Mapping[str, float]] | None = None) -> FallingEvidence | None:
    """The evidence at the newest of `samples` ((time, headroom) in time order), from those within the window
    (the newest minus window_seconds, inclusive, as a PromQL range of 2.x selects); None without samples.
    `start_remaining`, aligned with `samples`: per starting engine, what its start will still take from the
    headroom at each sample (`headroom_taken`; empty where none was starting); give window_seconds +
    start_lag_seconds of history."""
    if not samples:
        return None
    now, headroom = samples[-1]
    window = [(t, v) for t, v in samples if t >= now - rule.window_seconds]
    after_starts = None if start_remaining is None else _after_starts(samples, start_remaining, rule)
    return FallingEvidence(headroom_bytes=headroom, mem_total_bytes=mem_total_bytes,
                           slope_bytes_per_second=least_squares_slope(window),
                           drop_bytes=max(v for _, v in window) - headroom, samples=len(window),
                           after_starts_bytes=after_starts)


def _after_starts(samples: list[tuple[float, float]], start_remaining: Sequence[Mapping[str, float]],
                  rule: FallingRule) -> float | None:
    """Where the node ends once its starting engines are done, at the newest sample (FallingRule), as the rule
    file records node:memtel_node_unified_headroom_after_starts_bytes; None where no engine started within the
    window."""
    now, headroom = samples[-1]
    engines = {engine for remaining in start_remaining for engine in remaining}
    ends = []
    for engine in engines:
        best = None
        for i, (t, v) in enumerate(samples):
            if t < now - rule.start_lag_seconds:
                continue
            remaining = start_remaining[i].get(engine)
            if remaining is None:  # a start that ended within the window takes nothing more
                recent = any(engine in start_remaining[j] and samples[j][0] >= t - rule.window_seconds
                             for j in range(i))
                if not recent:
                    continue
                remaining = 0.0
            best = v - remaining if best is None else max(best, v - remaining)
        if best is not None:
            ends.append(best)
    return sum(ends) - (len(ends) - 1) * headroom if ends else None
