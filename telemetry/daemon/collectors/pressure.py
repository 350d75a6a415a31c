"""pressure collector: memory PSI (some/full stall time) from /proc/pressure/memory, as counters."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.core import Metric

from telemetry.catalogue.metrics import PRESSURE_KINDS
from telemetry.daemon.registry import register
from telemetry.procfs.pressure import PRESSURE_MEMORY_PATH, PressureLine, parse_pressure
from telemetry.procfs.procfile import ProcFile

if TYPE_CHECKING:
    from telemetry.daemon.settings import DaemonConfig

def pressure_families(lines: dict[str, PressureLine]) -> list[Metric]:
    return [family.new(lines[kind].total_seconds) for family, kind in PRESSURE_KINDS if kind in lines]


class PressureCollector:
    def __init__(self, path: str = PRESSURE_MEMORY_PATH) -> None:
        self.file = ProcFile(path, size=4096)

    def collect(self) -> list[Metric]:
        lines = parse_pressure(self.file.read_text())
        if not lines:
            raise ValueError(f"{self.file.path} has no PSI lines")
        return pressure_families(lines)


@register("pressure", order=30, help="memory stall time, PSI (`/proc/pressure/memory`)")
def build(config: DaemonConfig) -> PressureCollector:
    return PressureCollector(str(config.proc_root / "pressure" / "memory"))
