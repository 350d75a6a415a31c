"""The caching allocator's rules, one at a time, on the simulator."""

from __future__ import annotations

import pytest

from telemetry.model.allocsim import (
    CachingAllocatorSim,
    SimulatedOutOfMemoryError,
    allocation_size,
    parse_alloc_conf,
    round_size,
)

MIB = 1024 * 1024


def test_rounding_512_bytes_and_power2_divisions():
    default = parse_alloc_conf("")
    assert round_size(1, default) == 512
    assert round_size(513, default) == 1024
    assert round_size(1_653_823, default) == 1_654_272
    four = parse_alloc_conf("roundup_power2_divisions:4")
    assert round_size(1200 * MIB, four) == 1280 * MIB  # 1 GiB + the next quarter
    assert round_size(1024 * MIB, four) == 1024 * MIB  # a power of two stays
    assert round_size(1500, four) == 1536  # 1024 + 512: divisions of 256 below 2 KiB


def test_segment_sizes_small_large_and_rounded():
    assert allocation_size(512) == 2 * MIB
    assert allocation_size(MIB) == 2 * MIB
    assert allocation_size(MIB + 512) == 20 * MIB
    assert allocation_size(10 * MIB - 512) == 20 * MIB
    assert allocation_size(10 * MIB) == 10 * MIB
    assert allocation_size(11 * MIB + 1) == 12 * MIB


def test_small_requests_share_a_2mib_segment_and_large_ones_a_20mib_one():
    sim = CachingAllocatorSim()
    handles = [sim.malloc(100_000) for _ in range(20)]
    assert sim.num_device_alloc == 1 and sim.reserved_bytes == 2 * MIB
    big = [sim.malloc(3 * MIB) for _ in range(6)]
    assert sim.num_device_alloc == 2 + 0 and sim.reserved_bytes == 22 * MIB
    big.append(sim.malloc(3 * MIB))
    assert sim.num_device_alloc == 3  # 6 x 3 MiB filled 18 of 20 MiB; the 7th needs a new segment
    for h in handles + big:
        sim.free(h)
    assert sim.allocated_bytes == 0


def test_large_split_needs_more_than_1mib_remainder():
    sim = CachingAllocatorSim()
    h = sim.malloc(19 * MIB + 512)  # segment 20 MiB; remainder < 1 MiB: the whole block is handed out
    assert sim.allocated_bytes == 20 * MIB
    sim.free(h)
    h = sim.malloc(18 * MIB)  # remainder 2 MiB > 1 MiB: split
    assert sim.allocated_bytes == 18 * MIB


def test_empty_cache_releases_only_unsplit_segments():
    sim = CachingAllocatorSim()
    a = sim.malloc(4 * MIB)
    b = sim.malloc(4 * MIB)  # same 20 MiB segment as a
    c = sim.malloc(30 * MIB)
    sim.free(a)
    sim.free(c)
    sim.empty_cache()
    assert sim.reserved_bytes == 20 * MIB  # the split 20 MiB segment stays: b still lives in it
    assert sim.num_device_free == 1
    sim.free(b)
    sim.empty_cache()
    assert sim.reserved_bytes == 0 and sim.num_device_free == 2


def test_oversize_blocks_and_max_non_split_rounding():
    sim = CachingAllocatorSim("max_split_size_mb:256")
    h = sim.malloc(300 * MIB)
    sim.free(h)
    h = sim.malloc(290 * MIB)  # 300 < 290 + 20: the cached oversize block is reused whole
    assert sim.num_device_alloc == 1 and sim.allocated_bytes == 300 * MIB
    sim.free(h)
    h = sim.malloc(200 * MIB)  # below max_split: an oversize block is never split for it
    assert sim.num_device_alloc == 2
    sim.free(h)
    h = sim.malloc(270 * MIB)  # 300 >= 270 + 20: too much waste, new segment
    assert sim.num_device_alloc == 3


def test_out_of_memory_frees_cached_blocks_retries_then_raises():
    sim = CachingAllocatorSim(capacity_bytes=100 * MIB)
    a = sim.malloc(60 * MIB)
    sim.free(a)  # 60 MiB cached, unsplit
    b = sim.malloc(70 * MIB)  # 60 + 70 > 100: release the cache, retry, succeed
    assert sim.num_alloc_retries == 1 and sim.num_device_free == 1 and sim.num_ooms == 0
    assert sim.reserved_bytes == 70 * MIB
    with pytest.raises(SimulatedOutOfMemoryError, match="out of memory"):
        sim.malloc(40 * MIB)
    assert sim.num_ooms == 1 and sim.num_alloc_retries == 2
    sim.free(b)
    assert sim.stats()["allocated_bytes"] == 0


def test_expandable_segments_map_pages_and_unmap_on_empty_cache():
    mapped, unmapped = [], []
    sim = CachingAllocatorSim(
        "expandable_segments:True",
        on_segment_map=lambda seg, n: mapped.append((seg, n)),
        on_segment_unmap=lambda seg, n: unmapped.append((seg, n)),
    )
    a = sim.malloc(30 * MIB)  # two 20 MiB pages in one map call
    assert sim.reserved_bytes == 40 * MIB and sim.num_device_alloc == 1
    b = sim.malloc(15 * MIB)  # fits the 10 MiB left? no: maps one more page, a second call
    assert sim.reserved_bytes == 60 * MIB and sim.num_device_alloc == 2
    sim.free(a)
    sim.free(b)
    sim.empty_cache()
    assert sim.reserved_bytes == 0 and sim.num_device_free == 1
    assert sum(n for _, n in mapped) == sum(n for _, n in unmapped) == 60 * MIB
    assert sorted(mapped) == sorted(unmapped)


def test_segment_callbacks_balance_for_cudamalloc_segments():
    live: dict[int, int] = {}
    sim = CachingAllocatorSim(
        on_segment_map=lambda seg, n: live.__setitem__(seg, n), on_segment_unmap=lambda seg, n: live.__delitem__(seg)
    )
    hs = [sim.malloc(n * MIB) for n in (1, 5, 50, 500)]
    assert sum(live.values()) == sim.reserved_bytes
    for h in hs:
        sim.free(h)
    sim.empty_cache()
    assert live == {} and sim.reserved_bytes == 0


def test_free_of_unknown_handle_is_an_error_naming_it():
    sim = CachingAllocatorSim()
    h = sim.malloc(10)
    sim.free(h)
    with pytest.raises(KeyError, match=str(h)):
        sim.free(h)


def test_zero_byte_malloc_never_reaches_the_allocator():
    sim = CachingAllocatorSim()
    h = sim.malloc(0)
    assert sim.stats()["num_device_alloc"] == 0
    sim.free(h)
