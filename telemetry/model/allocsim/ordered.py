"""Ordered containers for the simulator, in O(log n) per operation like the real allocator's std::set.

`SortedList` keeps comparable, unique items in order, in buckets of at most `2 * load` items: finding
a bucket is a bisection over the buckets' largest items, and an insert or a delete moves at most one
bucket's items (a plain sorted Python list moves half the list: 40 µs at 100,000 items). With one bucket
it is a plain sorted list. `MaxTree` is a segment tree over slots numbered in order of arrival: set a
slot's value, and find the last slot whose value is at least x.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterator
from typing import Any

DEFAULT_LOAD = 256


class SortedList:
    """Unique, mutually comparable items in ascending order (the simulator keeps ints: size << 64 | address)."""

    __slots__ = ("_cap", "_lists", "_load", "_maxes")

    def __init__(self, items: Any = (), load: int = DEFAULT_LOAD) -> None:
        self._load = load
        self._cap = 2 * load  # a bucket is split when it grows beyond this
        self._lists: list[list[Any]] = []
        self._maxes: list[Any] = []
        ordered = sorted(items)
        for start in range(0, len(ordered), load):
            chunk = ordered[start:start + load]
            self._lists.append(chunk)
            self._maxes.append(chunk[-1])

    def __len__(self) -> int:
        return sum(map(len, self._lists))

    def __bool__(self) -> bool:
        return bool(self._maxes)

    def __iter__(self) -> Iterator[Any]:
        for sub in self._lists:
            yield from sub

    def __contains__(self, item: Any) -> bool:
        b = bisect_left(self._maxes, item)
        if b == len(self._maxes):
            return False
        sub = self._lists[b]
        return bool(sub[bisect_left(sub, item)] == item)

    def add(self, item: Any) -> None:
        maxes = self._maxes
        if len(maxes) == 1:  # the common case: a few hundred cached blocks at most, one bucket
            sub = self._lists[0]
            if item < maxes[0]:
                insort(sub, item)
            else:
                sub.append(item)
                maxes[0] = item
            if len(sub) > self._cap:
                self._split(0)
            return
        b = bisect_left(maxes, item)
        if b < len(maxes):
            sub = self._lists[b]
            insort(sub, item)
            if len(sub) > self._cap:
                self._split(b)
        elif b:
            b -= 1
            sub = self._lists[b]
            sub.append(item)
            maxes[b] = item
            if len(sub) > self._cap:
                self._split(b)
        else:
            self._lists.append([item])
            maxes.append(item)

    def _split(self, b: int) -> None:
        sub = self._lists[b]
        half = sub[self._load:]
        del sub[self._load:]
        self._maxes[b] = sub[-1]
        self._lists.insert(b + 1, half)
        self._maxes.insert(b + 1, half[-1])

    def remove(self, item: Any) -> None:
        """Remove `item` (equal by ==); KeyError if it is not there."""
        maxes = self._maxes
        b = 0 if len(maxes) == 1 else bisect_left(maxes, item)
        try:
            sub = self._lists[b]
            i = bisect_left(sub, item)
            if sub[i] != item:
                raise IndexError
        except IndexError:
            raise KeyError(item) from None
        del sub[i]
        if i == len(sub):
            if sub:
                maxes[b] = sub[-1]
            else:
                del self._lists[b]
                del maxes[b]

    def pop_ge(self, key: Any) -> Any:
        """Remove and return the first item >= key, or None (one search where ge + remove make two)."""
        maxes = self._maxes
        b = 0 if len(maxes) == 1 and not key > maxes[0] else bisect_left(maxes, key)
        if b == len(maxes):
            return None
        sub = self._lists[b]
        i = bisect_left(sub, key)
        item = sub.pop(i)
        if i == len(sub):
            if sub:
                maxes[b] = sub[-1]
            else:
                del self._lists[b]
                del maxes[b]
        return item

    def ge(self, key: Any) -> Any:
        """The first item >= key, or None."""
        maxes = self._maxes
        b = bisect_left(maxes, key)
        if b == len(maxes):
            return None
        sub = self._lists[b]
        return sub[bisect_left(sub, key)]

    def lt(self, key: Any) -> Any:
        """The last item < key, or None."""
        maxes = self._maxes
        b = bisect_left(maxes, key)
        if b < len(maxes):
            sub = self._lists[b]
            i = bisect_left(sub, key)
            if i:
                return sub[i - 1]
        return self._lists[b - 1][-1] if b else None

    def after(self, item: Any) -> Any:
        """The first item > item, or None."""
        maxes = self._maxes
        b = bisect_right(maxes, item)
        if b == len(maxes):
            return None
        sub = self._lists[b]
        return sub[bisect_right(sub, item)]

    def first(self) -> Any:
        return self._lists[0][0] if self._lists else None

    def last(self) -> Any:
        return self._maxes[-1] if self._maxes else None


class MaxTree:
    """Values in slots 0, 1, 2, ...: set one, or find the last slot whose value is >= x (both O(log n)).

    Empty slots hold -1. `capacity` grows by doubling; callers that keep taking new slots should
    renumber their live slots now and then (see DriverAddressSpace._compact).
    """

    __slots__ = ("_size", "_tree")

    def __init__(self, capacity: int = 64) -> None:
        size = 1
        while size < capacity:
            size *= 2
        self._size = size
        self._tree = [-1] * (2 * size)

    @property
    def capacity(self) -> int:
        return self._size

    def grow(self, capacity: int) -> None:
        old = self._tree[self._size:]
        self.__init__(capacity)  # type: ignore[misc]
        for slot, value in enumerate(old):
            if value >= 0:
                self.set(slot, value)

    def set(self, slot: int, value: int) -> None:
        tree = self._tree
        i = slot + self._size
        tree[i] = value
        i >>= 1
        while i:
            left = tree[2 * i]
            right = tree[2 * i + 1]
            best = left if left >= right else right
            if tree[i] == best:
                break
            tree[i] = best
            i >>= 1

    def get(self, slot: int) -> int:
        return self._tree[slot + self._size]

    def last_at_least(self, value: int) -> int | None:
        """The highest slot whose value is >= `value`, or None."""
        tree = self._tree
        if tree[1] < value:
            return None
        i = 1
        size = self._size
        while i < size:
            i = 2 * i + 1 if tree[2 * i + 1] >= value else 2 * i
        return i - size
