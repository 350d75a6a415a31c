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
from telemetry.daemon.registry import register
from telemetry.procfs.buddyinfo import BUDDYINFO_PATH
from telemetry.procfs.headroom import THP_SYSFS, FaultWindow, HeadroomReader
from telemetry.procfs.meminfo import MEMINFO_PATH
from telemetry.procfs.vmstat import VMSTAT_PATH

if TYPE_CHECKING:
    from telemetry.daemon.settings import DaemonConfig


class HeadroomCollector:
    """The figures of telemetry.procfs.headroom.HeadroomReader, the reading the daemon's protect also acts on."""

    def __init__(self, meminfo_path: str = MEMINFO_PATH, buddyinfo_path: str = BUDDYINFO_PATH,
                 page_size: int | None = None, vmstat_path: str = VMSTAT_PATH,
                 window: FaultWindow | None = None, thp_sysfs: str = THP_SYSFS) -> None:
        self.reader = HeadroomReader(meminfo_path, buddyinfo_path, page_size, vmstat_path, window, thp_sysfs)

    def collect(self) -> list[Metric]:
        reading = self.reader.read()
        families: list[Metric] = [UNIFIED_HEADROOM_WITHOUT_RECLAIM.new(reading.without_reclaim),
                                  UNIFIED_HEADROOM.new(reading.headroom)]
        if reading.success_ratio is not None:
            families.append(HUGE_PAGE_FAULT_SUCCESS_RATIO.new(reading.success_ratio))
        return families


@register("headroom", order=50, help="unified-memory headroom: MemAvailable against contiguous free memory and "
          "compaction (`/proc/meminfo`, `/proc/buddyinfo`, `/proc/vmstat`)")
def build(config: DaemonConfig) -> HeadroomCollector:
    root = config.proc_root
    return HeadroomCollector(str(root / "meminfo"), str(root / "buddyinfo"), vmstat_path=str(root / "vmstat"))
