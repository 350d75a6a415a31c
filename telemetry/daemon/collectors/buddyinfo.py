"""buddyinfo collector: free memory in blocks of at least 2 MiB, and free blocks per order.

A host can show a large MemAvailable while holding almost no free block of 2 MiB or more (page cache
and fragmentation after days of uptime); GPU drivers on unified memory ask for such blocks. The order
of a 2 MiB block comes from the real page size (4 KiB → 9, 16 KiB → 7, 64 KiB → 5).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.core import Metric

from telemetry.catalogue.metrics import MEM_FREE_BLOCKS, MEM_FREE_BUDDY, MEM_FREE_CONTIGUOUS, PAGE_SIZE
from telemetry.daemon.registry import register
from telemetry.procfs.buddyinfo import (
    BUDDYINFO_PATH,
    CONTIGUOUS_BLOCK_BYTES,
    ZoneFreeBlocks,
    free_blocks_by_order,
    free_bytes_in_blocks_of_at_least,
    read_free_blocks,
    system_page_size,
)
from telemetry.procfs.procfile import ProcFile

if TYPE_CHECKING:
    from telemetry.daemon.settings import DaemonConfig


def buddyinfo_families(zones: tuple[ZoneFreeBlocks, ...], page_size: int) -> list[Metric]:
    contiguous = MEM_FREE_CONTIGUOUS.new(free_bytes_in_blocks_of_at_least(zones, CONTIGUOUS_BLOCK_BYTES, page_size))
    listed = MEM_FREE_BUDDY.new(free_bytes_in_blocks_of_at_least(zones, 0, page_size))
    blocks = MEM_FREE_BLOCKS.new()
    for order, count in enumerate(free_blocks_by_order(zones)):
        blocks.add_metric([str(order)], count)
    page = PAGE_SIZE.new(page_size)
    return [contiguous, listed, blocks, page]


class BuddyinfoCollector:
    def __init__(self, path: str = BUDDYINFO_PATH, page_size: int | None = None) -> None:
        self.file = ProcFile(path)
        self.page_size = page_size or system_page_size()

    def collect(self) -> list[Metric]:
        return buddyinfo_families(read_free_blocks(self.file), self.page_size)


@register("buddyinfo", order=40, help="contiguous free memory, free blocks per order (`/proc/buddyinfo`)")
def build(config: DaemonConfig) -> BuddyinfoCollector:
    return BuddyinfoCollector(str(config.proc_root / "buddyinfo"))
