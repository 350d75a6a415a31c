"""meminfo collector: host memory, swap and huge pages from /proc/meminfo."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from telemetry.procfs.meminfo import MEMINFO_PATH, MeminfoReader
from telemetry.procfs.unaccounted import unaccounted_bytes

# (metric name, meminfo field, help); a field the kernel lacks leaves its metric out.
_GAUGES = (
    ("memtel_node_mem_total_bytes", "MemTotal", "Total usable memory (MemTotal)."),
    ("memtel_node_mem_available_bytes", "MemAvailable",
     "Memory available for new work without swapping (MemAvailable); GPU memory comes out of it on unified memory."),
    ("memtel_node_mem_free_bytes", "MemFree", "Unused memory (MemFree)."),
    ("memtel_node_mem_cached_bytes", "Cached", "Page cache (Cached)."),
    ("memtel_node_mem_buffers_bytes", "Buffers", "Block device buffers (Buffers)."),
    ("memtel_node_mem_shmem_bytes", "Shmem", "Shared memory and tmpfs (Shmem)."),
    ("memtel_node_swap_total_bytes", "SwapTotal", "Total swap space (SwapTotal)."),
    ("memtel_node_swap_free_bytes", "SwapFree", "Unused swap space (SwapFree)."),
    ("memtel_node_hugepages_configured_pages", "HugePages_Total",
     "Persistent huge pages of the default size set aside (HugePages_Total); not part of MemAvailable."),
    ("memtel_node_hugepages_free_pages", "HugePages_Free", "Huge pages not yet allocated (HugePages_Free)."),
    ("memtel_node_hugepages_reserved_pages", "HugePages_Rsvd",
     "Huge pages promised to mappings but not yet faulted in (HugePages_Rsvd)."),
    ("memtel_node_hugepages_surplus_pages", "HugePages_Surp", "Surplus huge pages (HugePages_Surp)."),
    ("memtel_node_hugepage_size_bytes", "Hugepagesize", "Default huge page size (Hugepagesize)."),
    ("memtel_node_hugetlb_bytes", "Hugetlb", "Memory held by huge pages of all sizes (Hugetlb)."),
)


def meminfo_families(values: dict[str, int]) -> Iterator[Metric]:
    for name, field, help_text in _GAUGES:
        if field in values:
            yield GaugeMetricFamily(name, help_text, value=values[field])
    if "SwapTotal" in values and "SwapFree" in values:
        yield GaugeMetricFamily(
            "memtel_node_swap_used_bytes", "Swap space in use (SwapTotal - SwapFree).",
            value=values["SwapTotal"] - values["SwapFree"],
        )
    unaccounted = unaccounted_bytes(values)
    if unaccounted is not None:
        yield GaugeMetricFamily(
            "memtel_node_mem_unaccounted_bytes",
            "Memory no /proc/meminfo field accounts for: MemTotal minus free, LRU, slab and other kernel fields "
            "(docs/metrics.md); on unified memory mostly what GPU drivers hold. Not clamped at 0.",
            value=unaccounted,
        )


class MeminfoCollector:
    def __init__(self, path: str = MEMINFO_PATH) -> None:
        self.reader = MeminfoReader(path)

    def collect(self) -> list[Metric]:
        values = self.reader.read()
        if "MemTotal" not in values:
            raise ValueError(f"{self.reader.path} has no MemTotal line: not a meminfo file")
        return list(meminfo_families(values))
