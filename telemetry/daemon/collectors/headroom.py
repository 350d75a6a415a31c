"""headroom collector: how much memory a GPU on unified memory could still get (telemetry.procfs.headroom).

    memtel_node_unified_headroom_bytes                 min(MemAvailable, free_contiguous + ratio × reclaimable)
    memtel_node_unified_headroom_without_reclaim_bytes min(MemAvailable, free memory in blocks >= 2 MiB)
    memtel_node_huge_page_fault_success_ratio          huge-page faults that got a huge page, last 5 minutes

The first is the headroom every alert, dashboard and forecast budget reads; the second is the figure before
reclaim and compaction (the headroom's old definition), kept as its own series. docs/metrics.md argues both.
meminfo, buddyinfo and vmstat are read on every collection; if one cannot be read the figures are left out.
The collector keeps one piece of state: the huge-page fault counters of the last window. It reads the THP
mode once, at start: a change of it takes a daemon restart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.core import Metric

from telemetry.catalogue.metrics import (
    HUGE_PAGE_FAULT_SUCCESS_RATIO,
    UNIFIED_HEADROOM,
    UNIFIED_HEADROOM_WITHOUT_RECLAIM,
)
from telemetry.daemon.collectors.buddyinfo import read_free_blocks
from telemetry.daemon.registry import register
from telemetry.procfs.buddyinfo import (
    BUDDYINFO_PATH,
    CONTIGUOUS_BLOCK_BYTES,
    free_bytes_in_blocks_of_at_least,
    system_page_size,
)
from telemetry.procfs.headroom import (
    THP_SYSFS,
    FaultWindow,
    headroom_without_reclaim,
    read_thp_mode,
    thp_faults_compact,
    unified_headroom,
)
from telemetry.procfs.meminfo import MEMINFO_PATH, MeminfoReader
from telemetry.procfs.procfile import ProcFile
from telemetry.procfs.vmstat import VMSTAT_PATH, parse_vmstat

if TYPE_CHECKING:
    from telemetry.daemon.settings import DaemonConfig


class HeadroomCollector:
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

    def collect(self) -> list[Metric]:
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
        families: list[Metric] = [UNIFIED_HEADROOM_WITHOUT_RECLAIM.new(headroom_without_reclaim(available, contiguous)),
                    UNIFIED_HEADROOM.new(unified_headroom(available, contiguous, ratio))]
        if ratio is not None:
            families.append(HUGE_PAGE_FAULT_SUCCESS_RATIO.new(ratio))
        return families


@register("headroom", order=50, help="unified-memory headroom: MemAvailable against contiguous free memory and "
          "compaction (`/proc/meminfo`, `/proc/buddyinfo`, `/proc/vmstat`)")
def build(config: DaemonConfig) -> HeadroomCollector:
    root = config.proc_root
    return HeadroomCollector(str(root / "meminfo"), str(root / "buddyinfo"), vmstat_path=str(root / "vmstat"))
