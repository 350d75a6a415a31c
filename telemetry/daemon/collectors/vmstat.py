"""vmstat collector: swap traffic, OOM kills and major faults from /proc/vmstat, as counters."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, Metric

from telemetry.procfs.procfile import ProcFile
from telemetry.procfs.vmstat import VMSTAT_PATH, parse_vmstat

# (vmstat field, help); metric names are memtel_node_vmstat_<field>_total.
_COUNTERS = (
    ("pswpin", "Pages swapped in since boot (pswpin)."),
    ("pswpout", "Pages swapped out since boot (pswpout)."),
    ("oom_kill", "Processes killed by the kernel OOM killer since boot (oom_kill)."),
    ("pgmajfault", "Major page faults since boot (pgmajfault)."),
)


def vmstat_families(values: dict[str, int]) -> list[Metric]:
    return [
        CounterMetricFamily(f"memtel_node_vmstat_{field}", help_text, value=values[field])
        for field, help_text in _COUNTERS
        if field in values
    ]


class VmstatCollector:
    def __init__(self, path: str = VMSTAT_PATH) -> None:
        self.file = ProcFile(path)

    def collect(self) -> list[Metric]:
        values = parse_vmstat(self.file.read_text())
        if not values:
            raise ValueError(f"{self.file.path} has no `name value` lines: not a vmstat file")
        return vmstat_families(values)
