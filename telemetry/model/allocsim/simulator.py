"""A deterministic model of PyTorch's CUDA caching allocator: one device, one stream.

It follows c10/cuda/CUDACachingAllocator.cpp rule for rule, so that after every `malloc`, `free`
and `empty_cache` the counters match the real allocator's `reserved_bytes.all.current`,
`allocated_bytes.all.current`, `num_device_alloc` and `num_device_free` exactly:

- sizes round up to 512 B, or to the next power-of-two division (`roundup_power2_divisions`);
- requests <= 1 MiB use the small pool (2 MiB segments), larger ones the large pool (20 MiB
  segments below 10 MiB, else the request rounded up to 2 MiB);
- a free block is found best-fit on (size, address); oversize rules with `max_split_size` and
  `max_non_split_rounding_size`; a block is split when the remainder is >= 512 B (small pool,
  expandable segments) or > 1 MiB and the request is below `max_split_size` (large pool);
- freed blocks merge with free neighbours; `empty_cache` releases only whole, unsplit segments;
- when cudaMalloc fails (beyond `capacity_bytes`): free oversize cached blocks, retry; free all
  unsplit cached blocks, retry (`num_alloc_retries`); then out of memory (`num_ooms`);
- `expandable_segments:True`: one growing segment per pool mapped in 2 MiB (small) or 20 MiB
  (large) pages, one `num_device_alloc` per map call and one `num_device_free` per unmap call.

Device addresses only break ties between free blocks of equal size in different segments; the
segments' base addresses come from a model of the CUDA driver's choices (driver_va.py).

`seed` starts the simulator from a live allocator's segments (a `torch.cuda.memory_snapshot()`, read
by snapshot.py) instead of an empty one. Free lists are ordered containers (ordered.py): every
malloc and free is O(log n) in the cached blocks, as in the real allocator's std::set; `empty_cache`
and garbage collection visit every cached block, as the real ones do.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .config import SIZE_MAX, AllocatorConfig, parse_alloc_conf
from .driver_va import DriverAddressSpace
from .ordered import SortedList

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1024 * 1024  # kSmallSize
SMALL_BUFFER = 2 * 1024 * 1024  # kSmallBuffer
LARGE_BUFFER = 20 * 1024 * 1024  # kLargeBuffer
MIN_LARGE_ALLOC = 10 * 1024 * 1024  # kMinLargeAlloc
ROUND_LARGE = 2 * 1024 * 1024  # kRoundLarge
DEFAULT_TOTAL_MEMORY = 150_109_880_320  # an H200's totalGlobalMem: sizes the expandable address space

ADDRESS_BITS = 64  # a free list key is size << 64 | address: ordered as BlockComparatorSize, compared as one int
ADDRESS_MASK = (1 << ADDRESS_BITS) - 1
SegmentCallback = Callable[[int, int], None]
SeedSegment = tuple[int, bool, bool, Sequence[tuple[int, bool]]]  # (address, small, expandable, [(size, live)])


class SimulatedOutOfMemoryError(MemoryError):
    """The simulated device could not satisfy a request, after freeing every cached block it could."""


class _Block:
    __slots__ = ("addr", "allocated", "es", "gc_base", "mapped", "next", "prev", "seg", "size", "small")

    def __init__(self, addr: int, size: int, small: bool, es: _Expandable | None = None, seg: int = 0) -> None:
        self.addr = addr
        self.size = size
        self.small = small
        self.allocated = False
        self.mapped = True
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.es = es
        self.seg = seg
        self.gc_base = 0


class _Pool:
    __slots__ = ("blocks", "free", "gc_calls", "small", "unmapped")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.free = SortedList()  # size << ADDRESS_BITS | address of each free block: BlockComparatorSize
        self.blocks: dict[int, _Block] = {}  # the free blocks by address
        self.unmapped: list[tuple[int, _Block]] = []  # (addr, block): BlockComparatorAddress
        self.gc_calls = 0

    def ordered(self) -> list[_Block]:
        """The free blocks in (size, address) order."""
        blocks = self.blocks
        return [blocks[key & ADDRESS_MASK] for key in self.free]


class _Expandable:
    """The reserved address range of one expandable segment and its mapped pages."""

    __slots__ = ("base", "page", "pages", "size")

    def __init__(self, base: int, page: int, npages: int) -> None:
        self.base = base
        self.page = page
        self.size = page * npages
        self.pages: dict[int, int] = {}  # page index -> callback id


def round_size(size: int, config: AllocatorConfig) -> int:
    """`round_size`: 512-byte multiples, or the next power-of-two division when configured."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    divisions = config.divisions_for(size)
    if divisions > 1 and size > MIN_BLOCK * divisions:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        rounded = size & ~(step - 1)
        return size if rounded == size else rounded + step
    return -(-size // MIN_BLOCK) * MIN_BLOCK


def allocation_size(size: int) -> int:
    """`get_allocation_size`: the size of a new segment for a (rounded) request."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class CachingAllocatorSim:
    """The caching allocator of one device and one stream, with the real allocator's counters.

    `config` is a `PYTORCH_CUDA_ALLOC_CONF` string (or a parsed AllocatorConfig).
    `capacity_bytes` is the device memory the allocator may reserve (None: unlimited).
    `release_cache_on_oom` False: beyond `capacity_bytes` the allocation fails at once, without freeing cached
    blocks and retrying first (what a limit this allocator does not see itself looks like: a share of a node
    that other processes may fill first).
    `total_memory` is the device's total memory, which `per_process_memory_fraction` is a fraction of and which
    sizes the expandable segments' address range (None: `capacity_bytes`, else an H200's).
    `on_segment_map(segment_id, nbytes)` / `on_segment_unmap(segment_id, nbytes)` are called when
    device memory is mapped (cudaMalloc, or one page of an expandable segment) and released; ids
    are unique for the life of the simulator.
    `address_space`: the driver's cudaMalloc addresses, anything with `alloc(size) -> address` and
    `release(address, size)` (default: a fresh DriverAddressSpace, a process that just started).
    Share one across simulators that stand for one process, one after another.
    `device_calls`: set it to a list to log every call to the device, in order, as the allocator's
    trace names them: ("segment_alloc" | "segment_free" | "segment_map" | "segment_unmap", address, nbytes).
    """

    def __init__(
        self,
        config: str | AllocatorConfig = "",
        capacity_bytes: int | None = None,
        on_segment_map: SegmentCallback | None = None,
        on_segment_unmap: SegmentCallback | None = None,
        address_space: Any = None,
        total_memory: int | None = None,
        release_cache_on_oom: bool = True,
    ) -> None:
        self.config = config if isinstance(config, AllocatorConfig) else parse_alloc_conf(config)
        self.release_cache_on_oom = release_cache_on_oom
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 or None, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        if total_memory is not None and total_memory < 1:
            raise ValueError(f"total_memory must be positive or None, got {total_memory}")
        self._total_memory = total_memory or capacity_bytes or DEFAULT_TOTAL_MEMORY
        self._on_map = on_segment_map
        self._on_unmap = on_segment_unmap
        cfg = self.config
        self._max_split = cfg.max_split_size
        self._max_non_split = cfg.max_non_split_rounding_size
        self._expandable = cfg.expandable_segments
        self._expandable_blocks = self._expandable  # whether a free list can hold blocks of expandable segments
        self._set_fraction = cfg.per_process_memory_fraction is not None and cfg.per_process_memory_fraction < 1.0
        fraction = cfg.per_process_memory_fraction if self._set_fraction else 1.0
        self._allowed_max = int(fraction * self._total_memory)  # type: ignore[operator]
        self._gc = self._set_fraction and cfg.garbage_collection_threshold > 0.0
        self._small = _Pool(True)
        self._large = _Pool(False)
        self._live: dict[int, _Block | None] = {}
        self._next_handle = 1
        self._next_segment = 1
        self._va = address_space if address_space is not None else DriverAddressSpace()
        self._own_va = address_space is None
        self.device_calls: list[tuple[str, int, int]] | None = None
        self._es_next_base = 0x2000_0000_0000_0000
        self.reserved_bytes = 0
        self.allocated_bytes = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0

    # ---- public interface -------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        return {
            "reserved_bytes": self.reserved_bytes,
            "allocated_bytes": self.allocated_bytes,
            "num_device_alloc": self.num_device_alloc,
            "num_device_free": self.num_device_free,
            "num_alloc_retries": self.num_alloc_retries,
            "num_ooms": self.num_ooms,
        }

    @property
    def address_space(self) -> Any:
        """The model of the driver's cudaMalloc addresses this simulator uses."""
        return self._va

    def live_handles(self) -> int:
        return len(self._live)

    def block_size(self, handle: int) -> int:
        """Bytes the allocator gave the allocation `handle` (its block, after rounding)."""
        block = self._live[handle]
        return 0 if block is None else block.size

    def block_address(self, handle: int) -> int | None:
        """The address of the allocation `handle`'s block (None for a zero-byte allocation)."""
        block = self._live[handle]
        return None if block is None else block.addr

    def malloc(self, nbytes: int) -> int:
        """Allocate `nbytes` (as `torch.empty(nbytes, dtype=uint8)`); returns a handle for free()."""
        if nbytes < 0:
            raise ValueError(f"malloc size must be >= 0, got {nbytes}")
        handle = self._next_handle
        self._next_handle += 1
        # A zero-byte tensor never reaches the caching allocator.
        self._live[handle] = self._malloc(nbytes) if nbytes else None
        return handle

    def free(self, handle: int) -> None:
        try:
            block = self._live.pop(handle)
        except KeyError:
            raise KeyError(f"free of unknown handle {handle!r}: not allocated, or already freed") from None
        if block is not None:
            self._free_block(block)

    def empty_cache(self) -> None:
        self._release_cached_blocks()

    def snapshot(self, device: int = 0) -> list[dict[str, Any]]:
        """The segments in `torch.cuda.memory_snapshot()`'s format (no requested sizes or frames).

        As PyTorch reports them: by address, one entry per cudaMalloc segment or per contiguous
        mapped range of an expandable segment, blocks in address order with their state.
        """
        heads: dict[int, _Block] = {}
        blocks = [b for pool in (self._small, self._large) for b in pool.blocks.values()]
        blocks += [b for b in self._live.values() if b is not None]
        for head in blocks:
            while head.prev is not None and head.prev.mapped:
                head = head.prev
            heads[head.addr] = head
        out = []
        for address in sorted(heads):
            block: _Block | None = heads[address]
            entries: list[dict[str, Any]] = []
            allocated = 0
            while block is not None and block.mapped:
                entries.append({"address": block.addr, "size": block.size,
                                "state": "active_allocated" if block.allocated else "inactive"})
                allocated += block.size if block.allocated else 0
                block = block.next
            total = sum(e["size"] for e in entries)
            head = heads[address]
            out.append({"device": device, "address": address, "total_size": total, "allocated_size": allocated,
                        "active_size": allocated, "stream": 0, "segment_type": "small" if head.small else "large",
                        "segment_pool_id": (0, 0), "is_expandable": head.es is not None, "blocks": entries})
        return out

    # ---- seeding from a live allocator --------------------------------------------------------

    def seed(self, segments: Iterable[SeedSegment], opaque: Iterable[tuple[int, int, int]] = ()) -> list[int]:
        """Start from a live allocator's state instead of an empty one; returns the live blocks' handles.

        segments: the default pools' segments, `(address, small, expandable, [(size, live), ...])`,
            blocks in address order from the segment's address; for expandable segments, each
            contiguous mapped range (what a snapshot reports as one segment).
        opaque: `(address, total_size, allocated_bytes)` of segments this simulator never allocates
            from (private pools): counted in reserved and allocated bytes, holding their addresses.

        Live blocks stay live (free them through the returned handles, if ever); free blocks are
        cached and reusable; the driver-address model continues from the real addresses (unless an
        `address_space` was given). An expandable segment is taken to begin at its lowest mapped
        page. Counters of events (num_device_alloc, ...) start at 0. Blocks a snapshot shows as
        waiting for another stream are free here (their streams are taken to be done).
        """
        if self.reserved_bytes or self._live or self.num_device_alloc:
            raise ValueError("seed() needs a fresh simulator: this one has allocated already")
        regular: list[tuple[int, bool, Sequence[tuple[int, bool]]]] = []
        expandable: dict[bool, list[tuple[int, Sequence[tuple[int, bool]]]]] = {True: [], False: []}
        for address, small, is_expandable, blocks in segments:
            if not blocks:
                raise ValueError(f"segment at {address:#x} has no blocks")
            (expandable[small].append((address, blocks)) if is_expandable else regular.append((address, small, blocks)))
        opaque = list(opaque)
        if self._own_va:
            ranges = [(a, sum(size for size, _ in b)) for a, _, b in regular] + [(a, n) for a, n, _ in opaque]
            self._va = DriverAddressSpace.from_segments(ranges)
        to_free: list[_Block] = []
        handles: list[int] = []
        for address, small, blocks in sorted(regular, key=lambda r: r[0]):
            segment = self._next_segment
            self._next_segment += 1
            last = self._seed_chain(address, small, blocks, None, segment, None, to_free, handles)
            self.reserved_bytes += last.addr + last.size - address
        for small, group in expandable.items():
            if group:
                self._seed_expandable(small, sorted(group, key=lambda r: r[0]), to_free, handles)
        for _address, total, allocated in opaque:
            self.reserved_bytes += total
            self.allocated_bytes += allocated
        for block in to_free:
            self._free_block(block)
        return handles

    def _seed_chain(self, address: int, small: bool, blocks: Sequence[tuple[int, bool]], es: _Expandable | None,
                    segment: int, previous: _Block | None, to_free: list[_Block], handles: list[int]) -> _Block:
        """Link a segment's blocks after `previous` (all allocated for now); returns the last block."""
        cursor = address
        block = previous
        for size, live in blocks:
            block = _Block(cursor, size, small, es, segment)
            block.allocated = True
            block.prev = previous
            if previous is not None:
                previous.next = block
            previous = block
            cursor += size
            self.allocated_bytes += size
            if live:
                handle = self._next_handle
                self._next_handle += 1
                self._live[handle] = block
                handles.append(handle)
            else:
                to_free.append(block)
        assert block is not None
        return block

    def _seed_expandable(self, small: bool, ranges: list[tuple[int, Sequence[tuple[int, bool]]]],
                         to_free: list[_Block], handles: list[int]) -> None:
        pool = self._small if small else self._large
        page = SMALL_BUFFER if small else LARGE_BUFFER
        base = ranges[0][0]
        self._expandable_blocks = True
        space = self._total_memory + self._total_memory // 8
        es = _Expandable(base, page, -(-space // page))
        cursor = base
        last: _Block | None = None

        def unmapped(start: int, size: int) -> _Block:
            block = _Block(start, size, small, es)
            block.mapped = False
            block.prev = last
            if last is not None:
                last.next = block
            insort(pool.unmapped, (block.addr, block))
            return block

        for address, blocks in ranges:
            total = sum(size for size, _ in blocks)
            if (address - base) % page or total % page:
                raise ValueError(f"expandable segment at {address:#x} ({total} bytes) is not made of whole "
                                 f"{page // (1024 * 1024)} MiB pages from {base:#x}")
            if address + total > base + es.size:
                raise ValueError(f"expandable segments span more than the device's address reservation "
                                 f"({es.size} bytes from {base:#x})")
            if address > cursor:
                last = unmapped(cursor, address - cursor)
            last = self._seed_chain(address, small, blocks, es, 0, last, to_free, handles)
            for index in range((address - base) // page, (address + total - base) // page):
                es.pages[index] = self._next_segment
                self._next_segment += 1
            self.reserved_bytes += total
            cursor = address + total
        if cursor < base + es.size:
            unmapped(cursor, base + es.size - cursor)
        self._es_next_base = max(self._es_next_base, base + es.size + (1 << 48))

    # ---- malloc path ------------------------------------------------------------------------

    def _malloc(self, orig_size: int) -> _Block:
        size = round_size(orig_size, self.config)
        pool = self._small if size <= SMALL_SIZE else self._large
        block = self._get_free_block(pool, size)
        if block is None:
            alloc_size = allocation_size(size)
            if self._gc:
                self._garbage_collect()
            block = self._alloc_block(pool, size, alloc_size, False)
            if block is None and self.release_cache_on_oom and self._release_available_cached_blocks(pool, size):
                block = self._alloc_block(pool, size, alloc_size, False)
            if block is None and self.release_cache_on_oom:
                self._release_cached_blocks()
                block = self._alloc_block(pool, size, alloc_size, True)
            if block is None:
                self.num_ooms += 1
                raise SimulatedOutOfMemoryError(
                    f"simulated CUDA out of memory: tried to allocate {alloc_size} bytes; capacity "
                    f"{self.capacity_bytes} bytes, {self.reserved_bytes} reserved, {self.allocated_bytes} allocated"
                )
        remaining = block.size - size
        if pool.small or self._expandable:
            split = remaining >= MIN_BLOCK
        else:
            split = size < self._max_split and remaining > SMALL_SIZE
        if split:
            # The front `size` bytes become a new allocated block; the rest stays free in the pool.
            front = _Block(block.addr, size, block.small, block.es, block.seg)
            front.prev = block.prev
            if front.prev is not None:
                front.prev.next = front
            front.next = block
            block.prev = front
            block.addr += size
            block.size = remaining
            self._insert_free(pool, block)
            block = front
        block.allocated = True
        self.allocated_bytes += block.size
        return block

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        if self._gc:
            pool.gc_calls += 1
        free = pool.free
        if not self._expandable_blocks:
            # The common case, no expandable blocks: take the best fit, put it back if the oversize rules refuse it.
            key = free.pop_ge(size << ADDRESS_BITS)
            if key is None:
                return None
            block = pool.blocks[key & ADDRESS_MASK]
            max_split = self._max_split
            if (size < max_split <= block.size) or (size >= max_split and block.size >= size + self._max_non_split):
                free.add(key)
                return None
            del pool.blocks[block.addr]
            return block
        key = free.ge(size << ADDRESS_BITS)
        if key is None:
            return None
        at = pool.blocks
        block = at[key & ADDRESS_MASK]
        if block.es is not None:
            # Best fit counts the unmapped space an expandable block could grow into.
            def grow(b: _Block) -> int:
                n = b.next
                return b.size + (n.size if n is not None and not n.mapped else 0)

            following = free.after(key)
            while block.es is not None and following is not None:
                candidate = at[following & ADDRESS_MASK]
                if grow(candidate) >= grow(block):
                    break
                key, block = following, candidate
                following = free.after(key)
        max_split = self._max_split
        if size < max_split and block.size >= max_split:
            return None  # no oversize block for a small request
        if size >= max_split and block.size >= size + self._max_non_split:
            return None  # an oversize block only within max_non_split_rounding of the request
        free.remove(key)
        del at[block.addr]
        return block

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int, retry: bool) -> _Block | None:
        if retry:
            self.num_alloc_retries += 1
        if self._set_fraction and self.reserved_bytes + alloc_size > self._allowed_max:
            return None
        if self._expandable:
            return self._allocate_expandable(pool, size)
        if self.capacity_bytes is not None and self.reserved_bytes + alloc_size > self.capacity_bytes:
            return None
        segment = self._next_segment
        self._next_segment += 1
        block = _Block(self._va.alloc(alloc_size), alloc_size, pool.small, None, segment)
        self.reserved_bytes += alloc_size
        self.num_device_alloc += 1
        if self.device_calls is not None:
            self.device_calls.append(("segment_alloc", block.addr, alloc_size))
        if self._on_map is not None:
            self._on_map(segment, alloc_size)
        return block

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        max_split = self._max_split
        if max_split == SIZE_MAX:
            return False
        wanted = max(size, max_split)
        free, at = pool.free, pool.blocks
        key = free.ge(wanted << ADDRESS_BITS)
        if key is None or at[key & ADDRESS_MASK].es is not None:
            # No single block is large enough: free oversize blocks from the largest down.
            key = free.lt(wanted << ADDRESS_BITS if key is None else key)
            released = 0
            while released < wanted and key is not None:
                block = at[key & ADDRESS_MASK]
                if block.size < max_split:
                    break
                below = free.lt(key)
                if block.es is None:
                    released += block.size
                    self._release_block(pool, block)
                key = below
            return released >= wanted
        self._release_block(pool, at[key & ADDRESS_MASK])
        return True

    def _garbage_collect(self) -> None:
        """`garbage_collect_cached_blocks`: free the whole large-pool blocks not reused for longest.

        A block's age is the pool's free-block searches since it was last put into the pool; each pass frees
        every whole block at least as old as the average age of those left, until the pass that brings reserved
        bytes to the threshold. Blocks of expandable segments are counted in the average, never freed (as in
        torch 2.11). Which of several equal-size free blocks a request takes (the lowest address) decides
        the ages, so the device addresses matter here (whatif.TraceAddresses).
        """
        pool = self._large
        for block in self._gc_victims():
            self._release_block(pool, block)

    def _gc_victims(self) -> list[_Block]:
        """The blocks a garbage-collection pass would free now, in the order it frees them."""
        threshold = int(self.config.garbage_collection_threshold * self._allowed_max)
        if self.reserved_bytes <= threshold:
            return []
        target = self.reserved_bytes - threshold
        pool = self._large
        whole = [b for b in pool.ordered() if b.prev is None and b.next is None]
        if not whole:
            return []
        total_age = sum(pool.gc_calls - b.gc_base for b in whole)
        count = len(whole)
        reclaimed = 0
        freed = True
        victims: list[_Block] = []
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            kept = []
            for block in whole:  # (size, address) order, as the pool's set
                age = pool.gc_calls - block.gc_base
                if block.es is None and age >= age_threshold:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    victims.append(block)
                else:
                    kept.append(block)
            whole = kept
        return victims

    def garbage_collection_frees(self) -> list[int]:
        """The sizes a garbage-collection pass would cudaFree now (before an allocation that needs a segment).

        The allocation's own free-block search adds 1 to every age first, which changes no choice.
        """
        return [b.size for b in self._gc_victims()] if self._gc else []

    def empty_cache_frees(self) -> list[int] | None:
        """The sizes `empty_cache()` would cudaFree now, in its order; None if it would also unmap pages."""
        sizes = []
        for pool in (self._large, self._small):
            for block in pool.ordered():
                if block.es is not None:
                    return None
                if block.prev is None and block.next is None:
                    sizes.append(block.size)
        return sizes

    def _release_cached_blocks(self) -> None:
        for pool in (self._large, self._small):
            to_unmap = []
            for block in pool.ordered():
                if block.es is not None:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    self._release_block(pool, block)
            for block in to_unmap:
                self._unmap_block(pool, block)
                if block.prev is None and block.next is None and not block.mapped:
                    pool.unmapped.remove((block.addr, block))
                    block.es = None  # the reservation goes back; nothing was mapped

    def _release_block(self, pool: _Pool, block: _Block) -> None:
        pool.free.remove(block.size << ADDRESS_BITS | block.addr)
        del pool.blocks[block.addr]
        self._va.release(block.addr, block.size)
        self.reserved_bytes -= block.size
        self.num_device_free += 1
        if self.device_calls is not None:
            self.device_calls.append(("segment_free", block.addr, block.size))
        if self._on_unmap is not None:
            self._on_unmap(block.seg, block.size)

    # ---- free path --------------------------------------------------------------------------

    def _free_block(self, block: _Block) -> None:
        block.allocated = False
        self.allocated_bytes -= block.size
        pool = self._small if block.small else self._large
        self._try_merge(pool, block, block.prev)
        self._try_merge(pool, block, block.next)
        self._insert_free(pool, block)

    def _insert_free(self, pool: _Pool, block: _Block) -> None:
        block.gc_base = pool.gc_calls
        pool.free.add(block.size << ADDRESS_BITS | block.addr)
        pool.blocks[block.addr] = block

    def _try_merge(self, pool: _Pool, dst: _Block, src: _Block | None) -> None:
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        if src.mapped:
            pool.free.remove(src.size << ADDRESS_BITS | src.addr)
            del pool.blocks[src.addr]
        else:
            del pool.unmapped[bisect_left(pool.unmapped, (src.addr,))]
        dst.size += src.size

    # ---- expandable segments ----------------------------------------------------------------

    def _allocate_expandable(self, pool: _Pool, size: int) -> _Block | None:
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped and not self._map_block(pool, candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            following = candidate.next
            assert following is not None
            if not self._map_block(pool, following, min(size - candidate.size, following.size)):
                return None
            candidate = following  # it absorbed the free block before it
        pool.free.remove(candidate.size << ADDRESS_BITS | candidate.addr)
        del pool.blocks[candidate.addr]
        return candidate

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        for _, block in pool.unmapped:
            start = block
            if block.prev is not None and not block.prev.allocated:
                start = block.prev
            room = 0
            b: _Block | None = start
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                return start
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        space = self._total_memory + self._total_memory // 8
        es = _Expandable(self._es_next_base, page, -(-space // page))
        self._es_next_base += 1 << 48
        block = _Block(es.base, es.size, pool.small, es)
        block.mapped = False
        insort(pool.unmapped, (block.addr, block))
        return block

    def _map_block(self, pool: _Pool, block: _Block, size: int) -> bool:
        es = block.es
        assert es is not None
        page = es.page
        begin = (block.addr - es.base) // page
        end = -(-(block.addr + size - es.base) // page)
        nbytes = (end - begin) * page
        if nbytes == 0:
            return False
        if self.capacity_bytes is not None and self.reserved_bytes + nbytes > self.capacity_bytes:
            return False  # cuMemCreate fails; the pages created by this call are released again
        del pool.unmapped[bisect_left(pool.unmapped, (block.addr,))]
        block.mapped = True
        if nbytes < block.size:
            rest = _Block(block.addr + nbytes, block.size - nbytes, pool.small, es)
            rest.mapped = False
            rest.prev = block
            rest.next = block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            insort(pool.unmapped, (rest.addr, rest))
            block.size = nbytes
        self._try_merge(pool, block, block.prev)
        self._try_merge(pool, block, block.next)
        self._insert_free(pool, block)
        self.reserved_bytes += nbytes
        self.num_device_alloc += 1
        if self.device_calls is not None:
            self.device_calls.append(("segment_map", es.base + begin * page, nbytes))
        for index in range(begin, end):
            segment = self._next_segment
            self._next_segment += 1
            es.pages[index] = segment
            if self._on_map is not None:
                self._on_map(segment, page)
        return True

    def _unmap_block(self, pool: _Pool, block: _Block) -> None:
        es = block.es
        assert es is not None
        page = es.page
        begin = -(-(block.addr - es.base) // page)
        end = (block.addr + block.size - es.base) // page
        if begin >= end:
            return
        pool.free.remove(block.size << ADDRESS_BITS | block.addr)
        del pool.blocks[block.addr]
        start = es.base + begin * page
        nbytes = (end - begin) * page
        before = start - block.addr
        after = block.size - before - nbytes
        if before > 0:
            head = _Block(block.addr, before, pool.small, es)
            head.prev = block.prev
            if block.prev is not None:
                block.prev.next = head
            head.next = block
            block.prev = head
            self._insert_free(pool, head)
        if after > 0:
            tail = _Block(start + nbytes, after, pool.small, es)
            tail.next = block.next
            if block.next is not None:
                block.next.prev = tail
            tail.prev = block
            block.next = tail
            self._insert_free(pool, tail)
        block.addr = start
        block.size = nbytes
        block.mapped = False
        self._try_merge(pool, block, block.prev)
        self._try_merge(pool, block, block.next)
        insort(pool.unmapped, (block.addr, block))
        self.reserved_bytes -= nbytes
        self.num_device_free += 1
        if self.device_calls is not None:
            self.device_calls.append(("segment_unmap", start, nbytes))
        for index in range(begin, end):
            segment = es.pages.pop(index)
            if self._on_unmap is not None:
                self._on_unmap(segment, page)
