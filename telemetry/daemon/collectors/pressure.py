"""pressure collector: memory PSI (some/full stall time) from /proc/pressure/memory, as counters."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, Metric

from telemetry.procfs.pressure import PRESSURE_MEMORY_PATH, PressureLine, parse_pressure
from telemetry.procfs.procfile import ProcFile

_HELP = {
    "some": "Time in which at least one task was stalled on memory (PSI some total).",
    "full": "Time in which all non-idle tasks were stalled on memory at once (PSI full total).",
}


def pressure_families(lines: dict[str, PressureLine]) -> list[Metric]:
    return [
        CounterMetricFamily(
            f"memtel_node_pressure_memory_{kind}_seconds", _HELP[kind], value=lines[kind].total_seconds
        )
        for kind in ("some", "full")
        if kind in lines
    ]


class PressureCollector:
    def __init__(self, path: str = PRESSURE_MEMORY_PATH) -> None:
        self.file = ProcFile(path, size=4096)

    def collect(self) -> list[Metric]:
        lines = parse_pressure(self.file.read_text())
        if not lines:
            raise ValueError(f"{self.file.path} has no PSI lines")
        return pressure_families(lines)
