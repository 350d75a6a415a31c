"""The O(log n) containers and driver model give exactly what the plain linear versions give."""

from __future__ import annotations

import random
from bisect import bisect_left, insort

import pytest

from telemetry.model.allocsim.driver_va import (
    ARENA_TOP,
    CHUNK_GRANULARITY,
    CONTEXT_HOLES,
    CONTEXT_SIZE,
    MAP_PAD,
    DriverAddressSpace,
)
from telemetry.model.allocsim.ordered import MaxTree, SortedList

MIB = 1024 * 1024


def test_sorted_list_agrees_with_a_plain_sorted_list():
    rng = random.Random(5)
    fast = SortedList(load=4)  # tiny buckets: splits and empty buckets happen all the time
    plain: list[tuple[int, int]] = []
    for step in range(6000):
        if plain and rng.random() < 0.45:
            item = plain.pop(rng.randrange(len(plain)))
            fast.remove(item)
        else:
            item = (rng.randrange(300), step)
            insort(plain, item)
            fast.add(item)
        key = (rng.randrange(310),)
        i = bisect_left(plain, key)
        assert fast.ge(key) == (plain[i] if i < len(plain) else None)
        assert fast.lt(key) == (plain[i - 1] if i else None)
        if plain:
            probe = plain[rng.randrange(len(plain))]
            j = plain.index(probe)
            assert fast.after(probe) == (plain[j + 1] if j + 1 < len(plain) else None)
            assert probe in fast
        assert len(fast) == len(plain)
    assert list(fast) == plain
    assert fast.first() == plain[0] and fast.last() == plain[-1]
    with pytest.raises(KeyError):
        fast.remove((999, 0))


def test_max_tree_finds_the_last_slot_at_least_a_value():
    rng = random.Random(6)
    tree = MaxTree(4)
    values: list[int] = []
    for _ in range(3000):
        if values and rng.random() < 0.5:
            slot = rng.randrange(len(values))
        else:
            slot = len(values)
            values.append(-1)
            if slot >= tree.capacity:
                tree.grow(tree.capacity * 2)
        values[slot] = rng.choice([-1, rng.randrange(100)])
        tree.set(slot, values[slot])
        want = rng.randrange(105)
        expected = max((i for i, v in enumerate(values) if v >= want), default=None)
        assert tree.last_at_least(want) == expected


class _LinearChunk:
    def __init__(self, start: int, end: int, permanent: bool = False) -> None:
        self.start, self.end, self.permanent = start, end, permanent
        self.used: list[tuple[int, int]] = []

    def holes(self) -> list[tuple[int, int]]:
        out, cursor = [], self.start
        for addr, end in self.used:
            if addr > cursor:
                out.append((cursor, addr - cursor))
            cursor = end
        if self.end > cursor:
            out.append((cursor, self.end - cursor))
        return out


class LinearDriver:
    """The driver model as first written: every cudaMalloc scans every chunk and every range."""

    def __init__(self, top: int = ARENA_TOP) -> None:
        context = _LinearChunk(top - CONTEXT_SIZE, top, permanent=True)
        cursor = context.start
        for offset, size in sorted(CONTEXT_HOLES, reverse=True):
            if top - offset > cursor:
                context.used.append((cursor, top - offset))
            cursor = top - offset + size
        if cursor < top:
            context.used.append((cursor, top))
        self.chunks = {context.start: context}
        self.ranges = [(context.start, context.end)]
        self.owner: dict[int, _LinearChunk] = {}

    def alloc(self, size: int) -> int:
        for chunk in reversed(self.chunks.values()):
            fits = [(hole_size, hole) for hole, hole_size in chunk.holes() if hole_size >= size]
            if fits:
                addr = min(fits)[1]
                break
        else:
            size_c = -(-size // CHUNK_GRANULARITY) * CHUNK_GRANULARITY
            start = self.ranges[0][0] - size_c
            for i in range(len(self.ranges) - 1, 0, -1):
                if self.ranges[i][0] - self.ranges[i - 1][1] >= size_c + MAP_PAD:
                    start = self.ranges[i][0] - size_c
                    break
            chunk = _LinearChunk(start, start + size_c)
            self.chunks[start] = chunk
            insort(self.ranges, (start, start + size_c))
            addr = start
        insort(chunk.used, (addr, addr + size))
        self.owner[addr] = chunk
        return addr

    def release(self, addr: int, size: int) -> None:
        chunk = self.owner.pop(addr)
        del chunk.used[bisect_left(chunk.used, (addr,))]
        if not chunk.used and not chunk.permanent:
            del self.chunks[chunk.start]
            del self.ranges[bisect_left(self.ranges, (chunk.start,))]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_driver_model_gives_the_linear_models_addresses(seed):
    # Thousands of chunks (several range buckets), releases in the middle (gaps), reuse of gaps.
    rng = random.Random(seed)
    fast, slow = DriverAddressSpace(), LinearDriver()
    live: list[tuple[int, int]] = []
    for _ in range(4000):
        if live and rng.random() < 0.4:
            addr, size = live.pop(rng.randrange(len(live)))
            fast.release(addr, size)
            slow.release(addr, size)
        else:
            size = rng.choice([2 * MIB, 20 * MIB, rng.randrange(1, 400) * 2 * MIB, rng.randrange(1, 40) * 64 * MIB])
            addr = fast.alloc(size)
            assert addr == slow.alloc(size)
            live.append((addr, size))


def test_a_model_seeded_from_segments_continues_below_them_and_in_their_room():
    base = ARENA_TOP - 4096 * MIB
    segments = [(base, 100 * MIB), (base + 100 * MIB, 2 * MIB), (base + 256 * MIB, 64 * MIB)]
    space = DriverAddressSpace.from_segments(segments)
    # The lowest chunk (128 MiB for the 100 MiB segment) is the newest: its room takes a 20 MiB segment.
    assert space.alloc(20 * MIB) == base + 102 * MIB
    # Nothing has 200 MiB of room and the 128 MiB between the chunks is too narrow: below everything.
    assert space.alloc(200 * MIB) == base - 224 * MIB
    space.release(base + 256 * MIB, 64 * MIB)  # a real segment goes back like any other
    space.release(base, 100 * MIB)
    with pytest.raises(KeyError):
        space.release(base, 100 * MIB)


def test_pop_ge_removes_the_first_item_at_least_the_key():
    rng = random.Random(8)
    fast = SortedList(load=4)
    plain: list[int] = []
    for _ in range(3000):
        if rng.random() < 0.55:
            value = rng.randrange(10**6)
            if value not in plain:
                insort(plain, value)
                fast.add(value)
        else:
            key = rng.randrange(10**6)
            i = bisect_left(plain, key)
            expected = plain.pop(i) if i < len(plain) else None
            assert fast.pop_ge(key) == expected
        assert list(fast) == plain
