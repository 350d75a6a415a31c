"""/proc/pressure/<resource> (PSI): a pure parser.

Each line looks like `some avg10=0.12 avg60=0.05 avg300=0.01 total=123456`; `total` is the
accumulated stall time in microseconds. The `full` line is missing on old kernels and for the
cpu resource before 5.13: a missing line is absent from the result, not zero.
"""

from __future__ import annotations

from dataclasses import dataclass

PRESSURE_MEMORY_PATH = "/proc/pressure/memory"


@dataclass(frozen=True)
class PressureLine:
    avg10: float
    avg60: float
    avg300: float
    total_seconds: float


def parse_pressure(text: str) -> dict[str, PressureLine]:
    """Parse PSI text into {"some": PressureLine, "full": PressureLine} (the lines present)."""
    result: dict[str, PressureLine] = {}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind not in ("some", "full"):
            continue
        fields: dict[str, str] = {}
        for item in rest.split():
            key, sep, value = item.partition("=")
            if sep:
                fields[key] = value
        try:
            result[kind] = PressureLine(
                avg10=float(fields["avg10"]),
                avg60=float(fields["avg60"]),
                avg300=float(fields["avg300"]),
                total_seconds=int(fields["total"]) / 1e6,
            )
        except (KeyError, ValueError):
            continue
    return result
