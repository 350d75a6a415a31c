"""vmstat collector: swap traffic, OOM kills, major faults, compaction and huge-page faults from /proc/vmstat,
as counters."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.core import Metric

from telemetry.catalogue.metrics import VMSTAT_FIELDS
from telemetry.daemon.registry import register
from telemetry.procfs.procfile import ProcFile
from telemetry.procfs.vmstat import VMSTAT_PATH, parse_vmstat

if TYPE_CHECKING:
    from telemetry.daemon.settings import DaemonConfig

def vmstat_families(values: dict[str, int]) -> list[Metric]:
    return [family.new(values[field]) for family, field in VMSTAT_FIELDS if field in values]


class VmstatCollector:
    def __init__(self, path: str = VMSTAT_PATH) -> None:
        self.file = ProcFile(path)

    def collect(self) -> list[Metric]:
        values = parse_vmstat(self.file.read_text())
        if not values:
            raise ValueError(f"{self.file.path} has no `name value` lines: not a vmstat file")
        return vmstat_families(values)


@register("vmstat", order=20, help="swap traffic, OOM kills and page faults (`/proc/vmstat`)")
def build(config: DaemonConfig) -> VmstatCollector:
    return VmstatCollector(str(config.proc_root / "vmstat"))
