"""telemetry/model/allocsim/simulator.py: what mutation testing found unchecked (docs/testing.md, "Mutation
testing"): the counters `stats()` reports by name, and a handle's block. Pure, in-process, no GPU."""

from __future__ import annotations

import pytest

from telemetry.model.allocsim.simulator import CachingAllocatorSim, SimulatedOutOfMemoryError

MIB = 1 << 20


def test_a_handles_block_its_size_and_address():
    sim = CachingAllocatorSim()
    empty, first, second = sim.malloc(0), sim.malloc(1000), sim.malloc(1000)
    assert (sim.block_size(empty), sim.block_address(empty)) == (0, None)  # never reaches the allocator
    assert sim.block_size(first) == sim.block_size(second) == 1024  # 512-byte multiples
    # Both come from the one 2 MiB small segment, one after the other.
    assert sim.block_address(second) - sim.block_address(first) == 1024
    assert sim.block_size(sim.malloc(3 * MIB)) == 3 * MIB


def test_stats_names_each_counter_of_the_real_allocator():
    sim = CachingAllocatorSim(capacity_bytes=24 * MIB)
    sim.malloc(1000)
    sim.malloc(1000)
    big = sim.malloc(3 * MIB)
    # A 2 MiB small segment and a 20 MiB large one (a request under 10 MiB gets a 20 MiB segment).
    assert sim.stats() == {"reserved_bytes": 22 * MIB, "allocated_bytes": 2048 + 3 * MIB, "num_device_alloc": 2,
                           "num_device_free": 0, "num_alloc_retries": 0, "num_ooms": 0}
    sim.free(big)
    with pytest.raises(SimulatedOutOfMemoryError):
        sim.malloc(23 * MIB)  # 24 MiB: only after the cached 20 MiB segment is freed and retried, and still over
    assert sim.stats() == {"reserved_bytes": 2 * MIB, "allocated_bytes": 2048, "num_device_alloc": 2,
                           "num_device_free": 1, "num_alloc_retries": 1, "num_ooms": 1}


def test_a_capacity_of_zero_is_a_device_with_nothing_free():
    with pytest.raises(SimulatedOutOfMemoryError, match="capacity 0 bytes"):
        CachingAllocatorSim(capacity_bytes=0).malloc(1)


def test_the_memory_fraction_is_of_the_capacity_when_no_total_is_given():
    sim = CachingAllocatorSim("per_process_memory_fraction:0.5", capacity_bytes=40 * MIB)
    with pytest.raises(SimulatedOutOfMemoryError):
        sim.malloc(22 * MIB)  # over half of 40 MiB (of an H200's memory it would fit)


SMALL_AT, LARGE_AT, PRIVATE_AT = 0x7F00_0000_0000, 0x7F00_0040_0000, 0x7F10_0000_0000


def seeded(unmapped: list[tuple[int, int]]) -> tuple[CachingAllocatorSim, list[int]]:
    sim = CachingAllocatorSim(on_segment_unmap=lambda segment, nbytes: unmapped.append((segment, nbytes)))
    handles = sim.seed([(SMALL_AT, True, False, [(1024, True), (2 * MIB - 1024, False)]),
                        (LARGE_AT, False, False, [(20 * MIB, False)])],
                       opaque=[(PRIVATE_AT, 4 * MIB, 1 * MIB)])
    return sim, handles


def test_a_seeded_allocator_counts_its_segments_and_the_private_pools():
    unmapped: list[tuple[int, int]] = []
    sim, handles = seeded(unmapped)
    assert len(handles) == 1 and sim.block_address(handles[0]) == SMALL_AT
    # 2 + 20 MiB of segments and a 4 MiB private pool; 1 KiB live and the pool's 1 MiB.
    assert (sim.reserved_bytes, sim.allocated_bytes) == (26 * MIB, 1024 + MIB)
    sim.empty_cache()
    assert unmapped == [(2, 20 * MIB)]  # the large segment, the second seeded (ids from 1, by address)
    assert (sim.reserved_bytes, sim.allocated_bytes) == (6 * MIB, 1024 + MIB)


def test_only_a_fresh_allocator_can_be_seeded():
    sim = CachingAllocatorSim()
    sim.malloc(0)  # no device memory, but a handle
    with pytest.raises(ValueError, match="fresh simulator"):
        sim.seed([(SMALL_AT, True, False, [(2 * MIB, False)])])
    with pytest.raises(ValueError, match="segment at 0x7f0000000000 has no blocks"):
        CachingAllocatorSim().seed([(SMALL_AT, True, False, [])])


def test_a_snapshot_names_its_fields_as_torch_does():
    sim, _ = seeded([])
    small, large = sim.snapshot()
    assert (small["address"], small["total_size"], small["allocated_size"]) == (SMALL_AT, 2 * MIB, 1024)
    assert small["blocks"] == [{"address": SMALL_AT, "size": 1024, "state": "active_allocated"},
                               {"address": SMALL_AT + 1024, "size": 2 * MIB - 1024, "state": "inactive"}]
    assert (large["address"], large["allocated_size"], large["segment_type"]) == (LARGE_AT, 0, "large")


def test_with_max_split_an_oom_frees_the_largest_cached_blocks_until_enough():
    sim = CachingAllocatorSim("max_split_size_mb:20", capacity_bytes=100 * MIB)
    first, second = sim.malloc(30 * MIB), sim.malloc(40 * MIB)
    sim.malloc(26 * MIB)
    sim.free(first)
    sim.free(second)  # 96 MiB reserved, 70 of it cached in two blocks over max_split
    sim.malloc(50 * MIB)  # neither fits: free 40 MiB, still short, then 30 MiB; 26 + 50 reserved
    # Enough was freed this way, so no retry (freeing every cached block) was needed.
    assert (sim.reserved_bytes, sim.num_device_free, sim.num_alloc_retries, sim.num_ooms) == (76 * MIB, 2, 0, 0)


def test_an_expandable_segment_maps_no_page_past_the_capacity():
    sim = CachingAllocatorSim("expandable_segments:True", capacity_bytes=50 * MIB)
    sim.malloc(20 * MIB)  # one 20 MiB page
    with pytest.raises(SimulatedOutOfMemoryError):
        sim.malloc(40 * MIB)  # two more pages: 60 MiB mapped would be over 50
    assert sim.reserved_bytes == 20 * MIB


BASE = 0x7F00_0000_0000  # a device address as a snapshot reports one


def test_a_seeded_expandable_segment_grows_in_place_from_its_first_free_page():
    """The segment is taken to begin at its first mapped page: a free page there is where a larger block grows
    from, not a second segment (mutation testing: the range before the first page is empty, never a block)."""
    sim = CachingAllocatorSim("expandable_segments:True", capacity_bytes=200 * MIB)
    sim.seed([(BASE, False, True, [(20 * MIB, False)])])
    grown = sim.malloc(30 * MIB)
    assert sim.block_address(grown) == BASE
    assert [(s["address"], s["total_size"]) for s in sim.snapshot()] == [(BASE, 40 * MIB)]


def test_after_a_seed_a_new_expandable_segment_starts_past_every_reservation():
    sim = CachingAllocatorSim("expandable_segments:True", capacity_bytes=200 * MIB)
    sim.seed([(BASE, False, True, [(20 * MIB, True)])])
    small = sim.malloc(1000)   # the small pool has no segment yet: a new reservation
    assert sim.block_address(small) == 0x2000_0000_0000_0000 > BASE
