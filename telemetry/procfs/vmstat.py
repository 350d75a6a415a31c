"""/proc/vmstat: a pure parser.

Every line is `name value`; values are event counts (pages, faults, kills) since boot.
Fields the kernel does not print are absent from the mapping, never zero.
"""

from __future__ import annotations

VMSTAT_PATH = "/proc/vmstat"


def parse_vmstat(text: str) -> dict[str, int]:
    """Parse vmstat text into {field: value}; malformed lines are skipped."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2:
            continue
        try:
            values[parts[0]] = int(parts[1])
        except ValueError:
            continue
    return values
