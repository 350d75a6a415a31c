"""The model of the CUDA driver's cudaMalloc addresses, rule by rule (driver_va.py)."""

from __future__ import annotations

import pytest

from telemetry.model.allocsim.driver_va import ARENA_TOP, CONTEXT_SIZE, DriverAddressSpace

MIB = 1024 * 1024
BOTTOM = ARENA_TOP - CONTEXT_SIZE  # below the CUDA context: where new chunks start


def test_new_chunks_are_32_mib_multiples_stacked_down_from_the_context():
    va = DriverAddressSpace()
    a = va.alloc(180 * MIB)  # chunk of 192 MiB
    b = va.alloc(278 * MIB)  # chunk of 288 MiB, right below
    assert a == BOTTOM - 192 * MIB
    assert b == a - 288 * MIB


def test_small_allocations_fill_the_context_holes_best_fit_first():
    va = DriverAddressSpace()
    assert va.alloc(20 * MIB) == ARENA_TOP - 24 * MIB  # only the top hole fits 20 MiB
    assert va.alloc(2 * MIB) == ARENA_TOP - 98 * MIB  # the 2 MiB hole fits exactly: best fit
    assert va.alloc(2 * MIB) == ARENA_TOP - 4 * MIB  # what is left of the top hole
    assert va.alloc(4 * MIB) == BOTTOM - 32 * MIB  # nothing fits: a new 32 MiB chunk


def test_the_newest_chunk_with_room_takes_an_allocation_in_its_smallest_hole():
    va = DriverAddressSpace()
    old = va.alloc(180 * MIB)  # 12 MiB of room at the chunk's end
    new = va.alloc(278 * MIB)  # 10 MiB of room
    assert va.alloc(2 * MIB) == new + 278 * MIB  # the newest chunk, not the lowest or the oldest
    assert va.alloc(9 * MIB) == old + 180 * MIB  # only 8 MiB left in the newest one
    va.release(new, 278 * MIB)  # the chunk stays: its 2 MiB allocation is live
    assert va.alloc(100 * MIB) == new  # its smallest fitting hole, at the hole's start


def test_a_released_chunk_is_reused_only_by_a_chunk_32_mib_smaller():
    va = DriverAddressSpace()
    top = va.alloc(160 * MIB)
    middle = va.alloc(160 * MIB)
    va.alloc(160 * MIB)
    va.release(middle, 160 * MIB)  # a 160 MiB free range between two chunks
    assert va.alloc(130 * MIB) < middle - 160 * MIB  # a 160 MiB chunk does not fit there: below all
    va.release(top, 160 * MIB)  # now 320 MiB free: fits 160 + 32, at the top of the range
    assert va.alloc(150 * MIB) == BOTTOM - 160 * MIB


def test_order_of_frees_does_not_matter_and_everything_comes_back():
    sizes = [2 * MIB, 20 * MIB, 300 * MIB, 64 * MIB, 2 * MIB, 1100 * MIB]
    first = DriverAddressSpace()
    addrs = [first.alloc(s) for s in sizes]
    for addr, size in reversed(list(zip(addrs, sizes, strict=True))):
        first.release(addr, size)
    second = DriverAddressSpace()
    for addr, size in zip([second.alloc(s) for s in sizes], sizes, strict=True):
        second.release(addr, size)
    # Both are back at the start: the same addresses again.
    assert [first.alloc(s) for s in sizes] == addrs == [second.alloc(s) for s in sizes]


def test_release_of_an_unknown_address_is_an_error():
    with pytest.raises(KeyError):
        DriverAddressSpace().release(ARENA_TOP - 700 * MIB, 2 * MIB)
