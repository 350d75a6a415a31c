"""`released_cache`: the allocator state as torch.cuda.empty_cache() would leave it (the hook's "at best").

Checked against the simulator's own empty_cache (c10's `release_cached_blocks`, rule for rule) on busy allocators,
with the default settings and with expandable segments (where only the whole pages of free runs are unmapped).
"""

from __future__ import annotations

import random

import pytest

from telemetry.model.allocsim import CachingAllocatorSim
from telemetry.model.allocsim.snapshot import AllocatorState, read_allocator_state, released_cache

MIB = 1 << 20


def _busy(config: str, seed: int) -> CachingAllocatorSim:
    """An allocator that served mixed sizes and freed about half of them: cached segments, split blocks."""
    sim = CachingAllocatorSim(config)
    rng = random.Random(seed)
    live = [sim.malloc(50 * MIB)]
    for _ in range(120):
        if len(live) > 1 and rng.random() < 0.45:
            sim.free(live.pop(rng.randrange(1, len(live))))
        else:
            live.append(sim.malloc(rng.choice([rng.randint(1, MIB), rng.randint(MIB, 12 * MIB),
                                               rng.randint(12 * MIB, 90 * MIB)])))
    return sim


def _shape(state: AllocatorState) -> list[tuple[int, int, bool, bool, tuple[tuple[int, int, bool], ...]]]:
    return [(s.address, s.total_size, s.small, s.expandable, tuple((b.address, b.size, b.live) for b in s.blocks))
            for s in state.segments]


@pytest.mark.parametrize("config", ["", "expandable_segments:True"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_it_is_what_the_allocators_empty_cache_leaves(config, seed):
    sim = _busy(config, seed)
    before = read_allocator_state(sim.snapshot())
    sim.empty_cache()
    after = read_allocator_state(sim.snapshot())
    released = released_cache(before)
    assert after.counters.reserved_bytes < before.counters.reserved_bytes   # something was cached: the test bites
    assert _shape(released) == _shape(after)
    assert released.counters == after.counters
    assert released.counters.allocated_bytes == before.counters.allocated_bytes   # live blocks stay


def test_nothing_cached_is_the_same_state_and_private_pools_and_pending_frees_are_as_empty_cache_leaves_them():
    sim = CachingAllocatorSim("")
    sim.malloc(30 * MIB)
    state = read_allocator_state(sim.snapshot())
    assert released_cache(state) is state   # the hook then reuses the search it already ran
    doc = [
        {"address": 0x1000_0000, "total_size": 20 * MIB, "blocks": [
            {"address": 0x1000_0000, "size": 20 * MIB, "state": "active_pending_free"}]},   # freed: released
        {"address": 0x2000_0000, "total_size": 20 * MIB, "blocks": [
            {"address": 0x2000_0000, "size": 4 * MIB, "state": "active_allocated"},
            {"address": 0x2000_0000 + 4 * MIB, "size": 16 * MIB, "state": "inactive"}]},       # one live block: kept
        {"address": 0x3000_0000, "total_size": 20 * MIB, "segment_pool_id": (1, 0), "blocks": [
            {"address": 0x3000_0000, "size": 20 * MIB, "state": "inactive"}]},                 # a private pool: kept
    ]
    state = read_allocator_state(doc)
    released = released_cache(state)
    assert [s.address for s in released.segments] == [0x2000_0000]
    assert released.private_segments == state.private_segments
    assert released.counters.reserved_bytes == 40 * MIB and released.counters.allocated_bytes == 4 * MIB
