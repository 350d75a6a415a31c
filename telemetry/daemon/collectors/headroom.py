"""headroom collector: one conservative figure of how much memory a GPU on unified memory could still get.

    memtel_node_unified_headroom_bytes = min(MemAvailable, free memory in blocks of at least 2 MiB)

MemAvailable counts page cache the kernel would have to reclaim first and says nothing about
fragmentation; the contiguous free memory counts only blocks a large-page allocation can take now.
The smaller of the two is what the reported failures ran into (docs/metrics.md argues the formula).
Both sources are read on every collection; if either cannot be read the figure is left out.
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily, Metric

from telemetry.daemon.collectors.buddyinfo import read_free_blocks
from telemetry.procfs.buddyinfo import (
    BUDDYINFO_PATH,
    CONTIGUOUS_BLOCK_BYTES,
    free_bytes_in_blocks_of_at_least,
    system_page_size,
)
from telemetry.procfs.meminfo import MEMINFO_PATH, MeminfoReader
from telemetry.procfs.procfile import ProcFile


def unified_headroom_bytes(mem_available: int, free_contiguous: int) -> int:
    return min(mem_available, free_contiguous)


class HeadroomCollector:
    def __init__(self, meminfo_path: str = MEMINFO_PATH, buddyinfo_path: str = BUDDYINFO_PATH,
                 page_size: int | None = None) -> None:
        self.meminfo = MeminfoReader(meminfo_path)
        self.buddyinfo = ProcFile(buddyinfo_path)
        self.page_size = page_size or system_page_size()

    def collect(self) -> list[Metric]:
        available, _ = self.meminfo.available_and_swap_free()  # the hook's fast read of the one field needed
        if available is None:
            raise ValueError(f"{self.meminfo.path} has no MemAvailable line (kernels before 3.14 lack it)")
        contiguous = free_bytes_in_blocks_of_at_least(read_free_blocks(self.buddyinfo), CONTIGUOUS_BLOCK_BYTES,
                                                      self.page_size)
        return [GaugeMetricFamily(
            "memtel_node_unified_headroom_bytes",
            "Conservative memory a GPU on unified memory could still get: min(MemAvailable, free memory in "
            "blocks of at least 2 MiB).",
            value=unified_headroom_bytes(available, contiguous),
        )]
