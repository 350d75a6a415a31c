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

Every call is O(log n) in the live chunks: the newest chunk with a big enough hole comes from a
segment tree over creation order, and the address ranges sit in buckets that know their widest gap
(ordered.py). `DriverAddressSpace.from_segments` starts the model from a live process's segments
(a snapshot's addresses) instead of a fresh process.
"""


from __future__ import annotations

from bisect import bisect_left, insort

from telemetry.errors import ConfigError

from .ordered import MaxTree

MIB = 1024 * 1024
CHUNK_GRANULARITY = 32 * MIB
MAP_PAD = 32 * MIB  # a new chunk needs a free range at least this much longer than itself
ARENA_TOP = 0x7F00_0000_0000
CONTEXT_SIZE = 512 * MIB
CONTEXT_HOLES = ((98 * MIB, 2 * MIB), (24 * MIB, 24 * MIB))  # (offset below the top, size)
RANGE_LOAD = 256


class _Chunk:
    __slots__ = ("end", "largest_hole", "permanent", "seq", "start", "used")

    def __init__(self, start: int, end: int, permanent: bool = False) -> None:
        self.start = start
        self.end = end
        self.used: list[tuple[int, int]] = []  # sorted (addr, end) of live allocations
        self.largest_hole = end - start
        self.permanent = permanent
        self.seq = -1

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
        # A chunk holds its first allocation and room of less than 32 MiB after it: a few entries.
        self.largest_hole = max((size for _, size in self.holes()), default=0)


class _Ranges:
    """Disjoint address ranges sorted by start; each knows the free gap below it (-1: the lowest).

    Buckets of starts keep their widest gap, so the highest range with a gap of at least L is found
    without visiting every range; `_wide` counts gaps of at least MAP_PAD, the smallest L ever asked.
    """

    __slots__ = ("_bmax", "_buckets", "_end", "_gap", "_lasts", "_wide")

    def __init__(self) -> None:
        self._buckets: list[list[int]] = []
        self._lasts: list[int] = []
        self._bmax: list[int] = []
        self._end: dict[int, int] = {}
        self._gap: dict[int, int] = {}
        self._wide = 0

    def __len__(self) -> int:
        return len(self._end)

    def lowest(self) -> int:
        return self._buckets[0][0]

    def _find(self, start: int) -> tuple[int, int]:
        b = bisect_left(self._lasts, start)
        return b, bisect_left(self._buckets[b], start)

    def _neighbours(self, start: int) -> tuple[int | None, int | None]:
        """The starts of the ranges just below and just above `start` (which need not be present)."""
        lasts, buckets = self._lasts, self._buckets
        b = bisect_left(lasts, start)
        below = above = None
        if b < len(buckets):
            sub = buckets[b]
            i = bisect_left(sub, start)
            if i:
                below = sub[i - 1]
            elif b:
                below = buckets[b - 1][-1]
            j = i + 1 if i < len(sub) and sub[i] == start else i
            if j < len(sub):
                above = sub[j]
            elif b + 1 < len(buckets):
                above = buckets[b + 1][0]
        elif buckets:
            below = buckets[-1][-1]
        return below, above

    def _set_gap(self, start: int, gap: int) -> None:
        old = self._gap[start]
        self._gap[start] = gap
        self._wide += (gap >= MAP_PAD) - (old >= MAP_PAD)
        b = bisect_left(self._lasts, start)
        if gap >= self._bmax[b]:
            self._bmax[b] = gap
        elif old == self._bmax[b]:
            self._bmax[b] = max(self._gap[s] for s in self._buckets[b])

    def insert(self, start: int, end: int) -> None:
        below, above = self._neighbours(start)
        gap = start - self._end[below] if below is not None else -1
        self._end[start] = end
        self._gap[start] = gap
        self._wide += gap >= MAP_PAD
        buckets, lasts, bmax = self._buckets, self._lasts, self._bmax
        if not buckets:
            buckets.append([start])
            lasts.append(start)
            bmax.append(gap)
        else:
            b = bisect_left(lasts, start)
            if b == len(buckets):
                b -= 1
                buckets[b].append(start)
                lasts[b] = start
            else:
                insort(buckets[b], start)
            if gap > bmax[b]:
                bmax[b] = gap
            sub = buckets[b]
            if len(sub) > 2 * RANGE_LOAD:
                half = sub[RANGE_LOAD:]
                del sub[RANGE_LOAD:]
                lasts[b] = sub[-1]
                buckets.insert(b + 1, half)
                lasts.insert(b + 1, half[-1])
                bmax[b] = max(self._gap[s] for s in sub)
                bmax.insert(b + 1, max(self._gap[s] for s in half))
        if above is not None:
            self._set_gap(above, above - end)

    def remove(self, start: int) -> None:
        below, above = self._neighbours(start)
        b, i = self._find(start)
        sub = self._buckets[b]
        del sub[i]
        gap = self._gap.pop(start)
        del self._end[start]
        self._wide -= gap >= MAP_PAD
        if not sub:
            del self._buckets[b], self._lasts[b], self._bmax[b]
        else:
            self._lasts[b] = sub[-1]
            if gap == self._bmax[b]:
                self._bmax[b] = max(self._gap[s] for s in sub)
        if above is not None:
            self._set_gap(above, above - self._end[below] if below is not None else -1)

    def highest_with_gap(self, width: int) -> int | None:
        """The start of the highest range with a free gap of at least `width` below it."""
        if width >= MAP_PAD and not self._wide:
            return None
        gap = self._gap
        for b in range(len(self._buckets) - 1, -1, -1):
            if self._bmax[b] >= width:
                for start in reversed(self._buckets[b]):
                    if gap[start] >= width:
                        return start
        return None


class AddressSpaceExhaustedError(ConfigError):
    """A workload maps more device memory than the address space holds (an op file or flag asked for it)."""


class DriverAddressSpace:
    """cudaMalloc / cudaFree addresses: `alloc(size) -> address`, `release(address, size)`.

    One instance stands for one process: keep it across the cases of a truth file (their capture
    ran them one after another in one process) to get the addresses the real run got.
    """

    def __init__(self, top: int | None = ARENA_TOP) -> None:
        self._tree = MaxTree(64)
        self._by_seq: list[_Chunk | None] = []
        self._live_chunks = 0
        self._ranges = _Ranges()
        self._owner: dict[int, _Chunk] = {}
        self._lowest_start: int | None = None   # the lowest chunk ever mapped: new chunks go below it when none is left
        if top is None:
            return
        context = _Chunk(top - CONTEXT_SIZE, top, permanent=True)
        cursor = context.start
        for offset, size in sorted(CONTEXT_HOLES, reverse=True):
            if top - offset > cursor:
                context.used.append((cursor, top - offset))
            cursor = top - offset + size
        if cursor < top:
            context.used.append((cursor, top))
        context._update()
        self._add_chunk(context)

    @classmethod
    def from_segments(cls, segments: list[tuple[int, int]]) -> DriverAddressSpace:
        """The address space of a live process whose cudaMalloc segments are `(address, size)`.

        The chunks are rebuilt from the real addresses by the model's own rule (a chunk starts at
        a segment and spans its size rounded up to 32 MiB; segments inside it filled its room);
        lower chunks count as newer (the driver stacks new chunks downwards). Where the CUDA context
        sits is not in a snapshot: the highest chunk is the top of the model.
        """
        if not segments:
            return cls()
        space = cls(top=None)
        chunks: list[_Chunk] = []
        for addr, size in sorted(segments):
            if chunks and addr < chunks[-1].end:
                chunk = chunks[-1]
                if chunk.used and addr < chunk.used[-1][1]:
                    raise ValueError(f"segments overlap at device address {addr:#x}")
                chunk.end = max(chunk.end, addr + size)
            else:
                chunk = _Chunk(addr, addr + -(-size // CHUNK_GRANULARITY) * CHUNK_GRANULARITY)
                chunks.append(chunk)
            chunk.used.append((addr, addr + size))
            space._owner[addr] = chunk
        for i in range(len(chunks) - 1):  # a chunk never reaches into the next one
            chunks[i].end = min(chunks[i].end, chunks[i + 1].start)
        for chunk in reversed(chunks):  # the lowest is the newest
            chunk._update()
            space._add_chunk(chunk)
        return space

    def alloc(self, size: int) -> int:
        seq = self._tree.last_at_least(size)
        if seq is not None:
            chunk = self._by_seq[seq]
            assert chunk is not None
            addr = min((hole_size, hole) for hole, hole_size in chunk.holes() if hole_size >= size)[1]
        else:
            chunk = self._new_chunk(-(-size // CHUNK_GRANULARITY) * CHUNK_GRANULARITY)
            addr = chunk.start
        chunk.take(addr, size)
        self._tree.set(chunk.seq, chunk.largest_hole)
        self._owner[addr] = chunk
        return addr

    def release(self, addr: int, size: int) -> None:
        try:
            chunk = self._owner.pop(addr)
        except KeyError:
            raise KeyError(f"release of device address {addr:#x}, which alloc() did not return "
                           "or was released") from None
        chunk.give_back(addr)
        if not chunk.used and not chunk.permanent:
            self._tree.set(chunk.seq, -1)
            self._by_seq[chunk.seq] = None
            self._live_chunks -= 1
            self._ranges.remove(chunk.start)
        else:
            self._tree.set(chunk.seq, chunk.largest_hole)

    def _add_chunk(self, chunk: _Chunk) -> None:
        if len(self._by_seq) == self._tree.capacity:
            self._compact()
        chunk.seq = len(self._by_seq)
        self._by_seq.append(chunk)
        self._live_chunks += 1
        self._tree.set(chunk.seq, chunk.largest_hole)
        self._ranges.insert(chunk.start, chunk.end)
        if self._lowest_start is None or chunk.start < self._lowest_start:
            self._lowest_start = chunk.start

    def _compact(self) -> None:
        """Renumber the live chunks 0, 1, ... in creation order (the tree has no free slot left)."""
        live = [c for c in self._by_seq if c is not None]
        capacity = self._tree.capacity
        self._tree = MaxTree(capacity * 2 if len(live) * 2 > capacity else capacity)
        self._by_seq = list(live)
        for seq, chunk in enumerate(live):
            chunk.seq = seq
            self._tree.set(seq, chunk.largest_hole)

    def _new_chunk(self, size: int) -> _Chunk:
        # At the top of the highest free range at least MAP_PAD longer than the chunk, else below all.
        above = self._ranges.highest_with_gap(size + MAP_PAD)
        if above is None:
            # Below all; a snapshot's space (no context chunk) whose every chunk was freed (a release of the whole
            # cache before an out-of-memory) starts below the lowest it had.
            above = self._ranges.lowest() if len(self._ranges) else self._lowest_start
            assert above is not None   # a space with a context chunk always has a range
        start = above - size
        if start < 0:
            raise AddressSpaceExhaustedError(
                f"mapping {size:,} bytes more exhausts the {ARENA_TOP:,}-byte device address space of the driver "
                "model; no device maps that much")
        chunk = _Chunk(start, start + size)
        self._add_chunk(chunk)
        return chunk
