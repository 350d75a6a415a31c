"""The call log's line format, written in one place: one JSON object per hooked call, on one line.

Keys in order: `ts` (unix seconds with 9 decimals), `call`, `site`, `rank`, `pid`, `node`, `device`, the
`AllocatorCounters` fields (absent without an allocator), `mem_available_bytes`, `swap_free_bytes` (null
where /proc/meminfo lacks them) and `shape` (`[rows, cols]`, only where asked for and found). The reader
is next to the file-name pattern in telemetry/hook/call_log.py.

Built for the hot path: a site's fixed part (site, rank, pid, node, device) is JSON-escaped once into a
`%` template, and the allocator and host parts are kept with the values they show and reused while
those repeat (they mostly do between consecutive calls). `ts` is written from integer nanoseconds, which
spares the float-to-shortest-string conversion that cost a third of a line. No json module per call.
"""

from __future__ import annotations

import json

from telemetry.allocator_counters import FIELDS, AllocatorCounters

NS_PER_S = 1_000_000_000

ALLOCATOR_PART = "".join(f',"{name}":%d' for name in FIELDS)


def memory_part(available: int | None, swap_free: int | None) -> str:
    return (f',"mem_available_bytes":{"null" if available is None else int(available)}'
            f',"swap_free_bytes":{"null" if swap_free is None else int(swap_free)}')


class SiteLine:
    """Formats the lines of one site (and device) of one process.

    Each cached part is one tuple, replaced whole: two threads recording the same site can never pair
    one record's values with another's text.
    """

    __slots__ = ("_allocator", "_head", "_head_shape", "_memory", "device")

    def __init__(self, site: str, device: str, rank: int, pid: int, node: str) -> None:
        fixed = json.dumps({"site": site, "rank": rank, "pid": pid, "node": node, "device": device},
                           separators=(",", ":"))[1:-1].replace("%", "%%")
        self.device = device
        # % (seconds, nanoseconds, call, allocator part, memory part[, rows, cols])
        self._head = '{"ts":%d.%09d,"call":%d,' + fixed + '%s%s}\n'
        self._head_shape = '{"ts":%d.%09d,"call":%d,' + fixed + '%s%s,"shape":[%d,%d]}\n'
        self._allocator: tuple[AllocatorCounters | None, str] = (None, "")
        self._memory: tuple[int | None, int | None, str] = (None, None, memory_part(None, None))

    def format(self, ts_ns: int, call: int, allocator: AllocatorCounters | None, available: int | None,
               swap_free: int | None, shape: list[int] | None = None) -> str:
        """The record as one line, newline included."""
        seconds, fraction = divmod(ts_ns, NS_PER_S)
        part = self._allocator
        if part[0] is not allocator:   # the CUDA reader hands back the same object while nothing changed
            part = self._allocator = (allocator, "" if allocator is None else ALLOCATOR_PART % allocator)
        memory = self._memory
        if memory[0] != available or memory[1] != swap_free:
            memory = self._memory = (available, swap_free, memory_part(available, swap_free))
        if shape is None:
            return self._head % (seconds, fraction, call, part[1], memory[2])
        return self._head_shape % (seconds, fraction, call, part[1], memory[2], shape[0], shape[1])


__all__ = ["ALLOCATOR_PART", "NS_PER_S", "SiteLine", "memory_part"]
