"""meminfo collector: host memory, swap and huge pages from /proc/meminfo."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import Metric

from telemetry.catalogue.metrics import MEM_UNACCOUNTED, MEMINFO_FIELDS, SWAP_USED
from telemetry.daemon.registry import register
from telemetry.procfs.meminfo import MEMINFO_PATH, MeminfoReader
from telemetry.procfs.unaccounted import unaccounted_bytes

if TYPE_CHECKING:
    from telemetry.daemon.settings import DaemonConfig

def meminfo_families(values: dict[str, int]) -> Iterator[Metric]:
    for family, field in MEMINFO_FIELDS:  # a field the kernel lacks leaves its metric out
        if field in values:
            yield family.new(values[field])
    if "SwapTotal" in values and "SwapFree" in values:
        yield SWAP_USED.new(values["SwapTotal"] - values["SwapFree"])
    unaccounted = unaccounted_bytes(values)
    if unaccounted is not None:
        yield MEM_UNACCOUNTED.new(unaccounted)


class MeminfoCollector:
    def __init__(self, path: str = MEMINFO_PATH) -> None:
        self.reader = MeminfoReader(path)

    def collect(self) -> list[Metric]:
        values = self.reader.read()
        if "MemTotal" not in values:
            raise ValueError(f"{self.reader.path} has no MemTotal line: not a meminfo file")
        return list(meminfo_families(values))


@register("meminfo", order=10, help="host memory, swap and huge pages (`/proc/meminfo`)")
def build(config: DaemonConfig) -> MeminfoCollector:
    return MeminfoCollector(str(config.proc_root / "meminfo"))
