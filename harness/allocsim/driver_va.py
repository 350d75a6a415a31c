"""The device addresses the CUDA driver gives cudaMalloc, modelled from allocator truth on an H200.

The caching allocator breaks ties between equal-size free blocks by device address, so the order of
segment base addresses decides which segment a request reuses. The rules below were found from the
real addresses (`tests/fixtures/allocator-truth/*.addresses.json`; torch 2.11, CUDA 13, driver 580,
Linux 6.18) and reproduce all 2,217 segment bases of the six cudaMalloc configs in order, 2,197 of
them at exactly the model's address plus a per-process constant (docs/lab.md, "How exact it is"):

- Chunks: a cudaMalloc that finds no room reserves a new chunk of its size rounded up to 32 MiB and
  sits at the chunk's start; the rest is room for later cudaMallocs. A chunk goes back when its
  last allocation is freed.
- Room first: a cudaMalloc goes into the newest chunk with a hole big enough, into that chunk's
  smallest such hole (lowest address on ties), at the hole's start.
- New chunks come from the process's address space like Linux's top-down mmap (the segments are
  PROT_NONE mappings in /proc/self/maps): at the top of the highest free range at least 32 MiB
  longer than the chunk (a chunk + 30 MiB reservation, 2 MiB huge-page alignment, trimmed to the
  32 MiB-aligned chunk), else below everything. Released chunks' ranges are reused this way.
- At start, the CUDA context and torch's start-up hold the 512 MiB below the top, except two holes:
  2 MiB at 98 MiB below the top (torch's first small segment, released by the first
  `empty_cache`) and the top 24 MiB.

Only the order of addresses matters to the simulator; the absolute values are arbitrary.
"""

from __future__ import annotations

from bisect import bisect_left, insort

MIB = 1024 * 1024
CHUNK_GRANULARITY = 32 * MIB
MAP_PAD = 32 * MIB  # a new chunk needs a free range at least this much longer than itself
ARENA_TOP = 0x7F00_0000_0000
CONTEXT_SIZE = 512 * MIB
CONTEXT_HOLES = ((98 * MIB, 2 * MIB), (24 * MIB, 24 * MIB))  # (offset below the top, size)


class _Chunk:
    __slots__ = ("end", "largest_hole", "permanent", "start", "used")

    def __init__(self, start: int, end: int, permanent: bool = False) -> None:
        self.start = start
        self.end = end
        self.used: list[tuple[int, int]] = []  # sorted (addr, end) of live allocations
        self.largest_hole = end - start
        self.permanent = permanent

    def holes(self) -> list[tuple[int, int]]:
        out = []
        cursor = self.start
        for addr, end in self.used:
            if addr > cursor:
                out.append((cursor, addr - cursor))
            cursor = end
        if self.end > cursor:
            out.append((cursor, self.end - cursor))
        return out

    def take(self, addr: int, size: int) -> None:
        insort(self.used, (addr, addr + size))
        self._update()

    def give_back(self, addr: int) -> None:
        del self.used[bisect_left(self.used, (addr,))]
        self._update()

    def _update(self) -> None:
        self.largest_hole = max((size for _, size in self.holes()), default=0)


class DriverAddressSpace:
    """cudaMalloc / cudaFree addresses: `alloc(size) -> address`, `release(address, size)`.

    One instance stands for one process: keep it across the cases of a truth file (their capture
    ran them one after another in one process) to get the addresses the real run got.
    """

    def __init__(self, top: int = ARENA_TOP) -> None:
        context = _Chunk(top - CONTEXT_SIZE, top, permanent=True)
        cursor = context.start
        for offset, size in sorted(CONTEXT_HOLES, reverse=True):
            if top - offset > cursor:
                context.used.append((cursor, top - offset))
            cursor = top - offset + size
        if cursor < top:
            context.used.append((cursor, top))
        context._update()
        self._chunks: dict[int, _Chunk] = {context.start: context}  # creation order, keyed by start
        self._ranges: list[tuple[int, int]] = [(context.start, context.end)]  # sorted, disjoint
        self._owner: dict[int, _Chunk] = {}

    def alloc(self, size: int) -> int:
        for chunk in reversed(self._chunks.values()):
            if chunk.largest_hole >= size:
                addr = min((hole_size, hole) for hole, hole_size in chunk.holes() if hole_size >= size)[1]
                break
        else:
            chunk = self._new_chunk(-(-size // CHUNK_GRANULARITY) * CHUNK_GRANULARITY)
            addr = chunk.start
        chunk.take(addr, size)
        self._owner[addr] = chunk
        return addr

    def release(self, addr: int, size: int) -> None:
        try:
            chunk = self._owner.pop(addr)
        except KeyError:
            raise KeyError(f"release of device address {addr:#x}, which alloc() did not return or was released") from None
        chunk.give_back(addr)
        if not chunk.used and not chunk.permanent:
            del self._chunks[chunk.start]
            del self._ranges[bisect_left(self._ranges, (chunk.start,))]

    def _new_chunk(self, size: int) -> _Chunk:
        ranges = self._ranges
        start = ranges[0][0] - size  # below everything, unless a free range higher up is long enough
        for i in range(len(ranges) - 1, 0, -1):
            if ranges[i][0] - ranges[i - 1][1] >= size + MAP_PAD:
                start = ranges[i][0] - size
                break
        chunk = _Chunk(start, start + size)
        self._chunks[start] = chunk
        insort(ranges, (start, start + size))
        return chunk
