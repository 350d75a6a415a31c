"""Markdown: tables, sections and the cell formats every report table uses (the one Markdown table writer).

A `Section` is a level-2 heading with its Markdown body, where it goes (`lead`: before the harness's
tables, `tail`: after them) and, optionally, its data for summary.json. Callers (the demo, later
statistics and verdicts) hand sections to `Report.write`; they never edit report.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from harness.ab.report.metrics import Spread
from harness.ab.report.stats import NO_DATA, NO_NOISE_ESTIMATE, Estimate, PairedDifference

Placement = Literal["lead", "tail"]


@dataclass(frozen=True)
class Table:
    header: list[str]
    rows: list[list[str]]

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.header) + " |", "| " + " | ".join("---" for _ in self.header) + " |"]
        lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in self.rows]
        return "\n".join(lines)

    def __bool__(self) -> bool:
        return bool(self.rows)


@dataclass(frozen=True)
class Section:
    """One `## title` section of report.md.

    key: names the section (summary.json's `sections.<key>` holds `data`; notes for it are appended).
    placement: `lead` (after the run's header, before the tables) or `tail` (after the tables, before the plots).
    """

    key: str
    title: str
    body: str
    placement: Placement = "tail"
    data: Any = None

    def markdown(self, notes: Sequence[str] = ()) -> str:
        parts = [f"## {self.title}", self.body.strip(), *[note.strip() for note in notes]]
        return "\n\n".join(part for part in parts if part)


@dataclass
class Document:
    """report.md: a header, then sections in order; notes (by section key) are appended to their section."""

    header: str
    sections: list[Section] = field(default_factory=list)
    notes: dict[str, list[str]] = field(default_factory=dict)

    def markdown(self) -> str:
        parts = [self.header.strip(), *[s.markdown(self.notes.get(s.key, ())) for s in self.sections]]
        return "\n\n".join(parts) + "\n"


# --- cells ---------------------------------------------------------------------------------------


def number(value: float | None, scale: float = 1.0, digits: int = 1, sign: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value / scale:{'+' if sign else ''},.{digits}f}"


def spread(value: Spread | None, scale: float = 1.0, digits: int = 1, sign: bool = False) -> str:
    """`median` for one value, `median [min–max]` for repeats, `n/a` for none."""
    if value is None:
        return "n/a"
    median = number(value.median, scale, digits, sign)
    if value.n == 1:
        return median
    return f"{median} [{number(value.low, scale, digits, sign)}–{number(value.high, scale, digits, sign)}]"


def estimate(value: Estimate | None, scale: float = 1.0, digits: int = 1, sign: bool = False) -> str:
    """`mean ± half-width` of the 95 % interval, the mean alone for one value, `n/a` for none."""
    if value is None:
        return "n/a"
    mean = number(value.mean, scale, digits, sign)
    if value.half_width is None:
        return mean
    return f"{mean} ± {number(value.half_width, scale, digits)}"


def interval(value: Estimate | None, scale: float = 1.0, digits: int = 1, sign: bool = False) -> str:
    """`[low, high]` of the 95 % interval, or what stands in for it."""
    if value is None:
        return "n/a"
    if value.low is None or value.high is None:
        return "one value: no interval"
    return f"[{number(value.low, scale, digits, sign)}, {number(value.high, scale, digits, sign)}]"


def difference(value: PairedDifference | None, scale: float, unit: str, digits: int = 1) -> str:
    """The paired A − B difference (mean over repeats) and what it says: significant, within the noise..."""
    if value is None or value.estimate is None or value.verdict == NO_DATA:
        return "n/a"
    text = f"{value.estimate.mean / scale:+,.{digits}f}{unit}"
    if value.verdict == NO_NOISE_ESTIMATE:
        return f"{text} (one repeat: no noise estimate)"
    return f"{text} ({value.verdict})"


def ranges(numbers: Sequence[int]) -> str:
    """1, 2, 3, 5 -> "1–3, 5"."""
    if not numbers:
        return ""
    parts, start = [], numbers[0]
    for a, b in zip(numbers, [*numbers[1:], None], strict=True):
        if b != a + 1:
            parts.append(f"{start}" if start == a else f"{start}–{a}")
            start = b if b is not None else a
    return ", ".join(parts)


__all__ = ["Document", "Placement", "Section", "Table", "difference", "estimate", "interval", "number", "ranges",
           "spread"]
