"""The call log's line format, written in one place: one JSON object per hooked call, on one line.

Keys in order: `ts` (unix seconds with 9 decimals), `call`, `site`, `rank`, `pid`, `node`, `device`, the
`AllocatorCounters` fields (absent without an allocator), `mem_available_bytes`, `swap_free_bytes` (null
where /proc/meminfo lacks them) and `shape` (`[rows, cols]`, only where asked for and found). The reader
is next to the file-name pattern in telemetry/hook/call_log.py.

Built for the hot path: everything after `call` (the site's fixed part, JSON-escaped once, then the
allocator and host parts) is kept as one text with the values it shows and reused while those repeat
(they mostly do between consecutive calls); `ts` is written from integer nanoseconds against the current
second, kept with its text. A line is then one f-string of two numbers and two kept texts: no `%`
template to parse, no division, no float-to-string conversion, no json module per call. The log writer's
`push` writes `SiteLine.format` out in place for lines without a shape (a Python call less per record;
tests/hook/test_call_log.py holds the two together).
"""

from __future__ import annotations

import json

from telemetry.allocator_counters import FIELDS, AllocatorCounters

NS_PER_S = 1_000_000_000
_NO_ALLOCATOR_YET = object()   # a new line's kept tail: never the allocator of a record

ALLOCATOR_PART = "".join(f',"{name}":%d' for name in FIELDS)

Second = tuple[int, str]                           # (the second's start in ns, the line up to its decimal point)
Tail = tuple[object, int | None, int | None, str]  # (allocator, available, swap_free, the text after `call`)


def memory_part(available: int | None, swap_free: int | None) -> str:
    return (f',"mem_available_bytes":{"null" if available is None else available}'
            f',"swap_free_bytes":{"null" if swap_free is None else swap_free}')


def second_of(ts_ns: int) -> Second:
    """The kept `ts` part for the second that holds `ts_ns`."""
    seconds = ts_ns // NS_PER_S
    return seconds * NS_PER_S, f'{{"ts":{seconds}.'


class SiteLine:
    """Formats the lines of one site (and device) of one process.

    Each kept part is one tuple, replaced whole: two threads recording the same site can never pair
    one record's values with another's text.
    """

    __slots__ = ("_fixed", "_head", "device", "second", "tail")

    def __init__(self, site: str, device: str, rank: int, pid: int, node: str) -> None:
        self._fixed = "," + json.dumps({"site": site, "rank": rank, "pid": pid, "node": node, "device": device},
                                       separators=(",", ":"))[1:-1]
        self.device = device
        self.second: Second = second_of(0)   # the first line finds its own second
        self.tail: Tail = (_NO_ALLOCATOR_YET, None, None, "")
        self._head: tuple[object, str] = (_NO_ALLOCATOR_YET, "")   # (allocator, fixed and allocator parts)

    def new_second(self, ts_ns: int) -> Second:
        second = self.second = second_of(ts_ns)
        return second

    def new_tail(self, allocator: AllocatorCounters | None, available: int | None, swap_free: int | None) -> Tail:
        head = self._head
        if head[0] is not allocator:   # else only the host part changed: the allocator's text is kept
            head = self._head = (allocator, self._fixed + ("" if allocator is None else ALLOCATOR_PART % allocator))
        tail = self.tail = (allocator, available, swap_free, head[1] + memory_part(available, swap_free))
        return tail

    def format(self, ts_ns: int, call: int, allocator: AllocatorCounters | None, available: int | None,
               swap_free: int | None, shape: list[int] | None = None) -> str:
        """The record as one line, newline included."""
        second = self.second
        fraction = ts_ns - second[0]
        if fraction >= NS_PER_S or fraction < 0:   # a new second (or the clock stepped back)
            second = self.new_second(ts_ns)
            fraction = ts_ns - second[0]
        tail = self.tail
        # `is` first: the CUDA reader hands back the same object while nothing changed.
        if tail[0] is not allocator or tail[1] != available or tail[2] != swap_free:
            tail = self.new_tail(allocator, available, swap_free)
        # fraction + NS_PER_S has 10 digits: without its leading 1, the 9 zero-padded decimals.
        if shape is None:
            return f'{second[1]}{str(fraction + NS_PER_S)[1:]},"call":{call}{tail[3]}}}\n'
        return (f'{second[1]}{str(fraction + NS_PER_S)[1:]},"call":{call}{tail[3]}'
                f',"shape":[{shape[0]},{shape[1]}]}}\n')


__all__ = ["ALLOCATOR_PART", "NS_PER_S", "Second", "SiteLine", "Tail", "memory_part", "second_of"]
