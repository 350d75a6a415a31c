"""Seeding, what-if planning and forecast on the simulator itself: a seeded simulator carries on exactly
as the one whose snapshot it was given, and a recorded simulator history replays exactly."""

from __future__ import annotations

import copy
import random

import pytest

from telemetry.model.allocsim import CachingAllocatorSim
from telemetry.model.allocsim.config import format_alloc_conf, parse_alloc_conf, same_settings
from telemetry.model.allocsim.recorder import RecordingSim
from telemetry.model.allocsim.snapshot import read_allocator_state, seeded_simulator, settings_alloc_conf
from telemetry.model.allocsim.trace import read_trace
from telemetry.model.allocsim.whatif import OP_EMPTY_CACHE, whatif
from telemetry.model.indexer.forecast import forecast
from telemetry.model.indexer.planner import MODES
from telemetry.model.indexer.prefill import run_prefill
from telemetry.model.indexer.shape import IndexerShape

MIB = 1024 * 1024
CONFIGS = ["", "expandable_segments:True", "max_split_size_mb:256,roundup_power2_divisions:4",
           "expandable_segments:True,roundup_power2_divisions:4"]


def _size(rng: random.Random) -> int:
    return rng.choice([rng.randint(1, MIB), rng.randint(MIB, 10 * MIB), rng.randint(10 * MIB, 300 * MIB)])


def _busy(config: str, seed: int) -> tuple[CachingAllocatorSim, list[int]]:
    sim = CachingAllocatorSim(config)
    rng = random.Random(seed)
    live = [sim.malloc(500_000), sim.malloc(50 * MIB)]  # resident first, as weights are: pools start mapped
    for _ in range(250):
        if len(live) > 2 and rng.random() < 0.45:
            sim.free(live.pop(rng.randrange(2, len(live))))
        else:
            live.append(sim.malloc(_size(rng)))
        if rng.random() < 0.01:
            sim.empty_cache()
    return sim, live


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_a_seeded_simulator_carries_on_as_the_original(config, seed):
    # Given where the driver puts new segments (the original's own address model), the seeded simulator is
    # the original: every block, pool and counter. Rebuilt from the addresses alone, the driver model is an
    # approximation that decides only ties between equal-size blocks (the H200 captures check it for real).
    original, _ = _busy(config, seed)
    state = read_allocator_state(original.snapshot())
    assert state.counters.reserved_bytes == original.reserved_bytes
    assert state.counters.allocated_bytes == original.allocated_bytes
    seeded = seeded_simulator(state, config, address_space=copy.deepcopy(original.address_space))
    base = (original.num_device_alloc, original.num_device_free)
    rng = random.Random(seed + 100)
    mine: list[tuple[int, int]] = []
    for _ in range(250):
        r = rng.random()
        if mine and r < 0.4:
            a, b = mine.pop(rng.randrange(len(mine)))
            original.free(a)
            seeded.free(b)
        elif r < 0.42:
            original.empty_cache()
            seeded.empty_cache()
        else:
            size = _size(rng)
            mine.append((original.malloc(size), seeded.malloc(size)))
        want = [original.reserved_bytes, original.allocated_bytes, original.num_device_alloc - base[0],
                original.num_device_free - base[1]]
        assert want == [seeded.reserved_bytes, seeded.allocated_bytes, seeded.num_device_alloc, seeded.num_device_free]


def test_live_blocks_stay_live_and_free_blocks_are_reused():
    sim = CachingAllocatorSim()
    keep = sim.malloc(30 * MIB)
    sim.free(sim.malloc(100 * MIB))
    state = read_allocator_state(sim.snapshot())
    seeded = seeded_simulator(state)
    assert seeded.live_handles() == 1
    reused = seeded.malloc(90 * MIB)  # fits the cached 100 MiB segment: no new memory
    assert seeded.num_device_alloc == 0 and seeded.reserved_bytes == sim.reserved_bytes
    seeded.free(reused)
    seeded.empty_cache()  # the snapshot's live block keeps its segment
    assert seeded.reserved_bytes == 30 * MIB and seeded.allocated_bytes == 30 * MIB
    del keep


def test_a_seeded_simulator_needs_a_fresh_one():
    sim = CachingAllocatorSim()
    sim.malloc(5)
    with pytest.raises(ValueError, match="fresh simulator"):
        sim.seed([])


@pytest.mark.parametrize("text", ["", "max_split_size_mb:256,roundup_power2_divisions:4", "expandable_segments:True",
                                  "roundup_power2_divisions:[256:1,512:2,1024:4,>:8],max_split_size_mb:512,"
                                  "max_non_split_rounding_mb:64",
                                  "per_process_memory_fraction:0.05,garbage_collection_threshold:0.6"])
def test_alloc_conf_strings_round_trip(text):
    config = parse_alloc_conf(text)
    assert same_settings(parse_alloc_conf(format_alloc_conf(config)), config)


def test_recorded_settings_trust_the_fields_over_the_last_string():
    # `_set_allocator_settings("expandable_segments:False")` after starting with max_split_size_mb:256 leaves that
    # string as the last one parsed while the allocator still splits at 256 MiB.
    settings = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False", "max_split_size": 256 * MIB,
                "garbage_collection_threshold": 0.0, "expandable_segments": False,
                "roundup_power2_divisions": {str(1 << i): 0 for i in range(16)}}
    assert settings_alloc_conf(settings) == "max_split_size_mb:256"
    settings["max_split_size"] = -1  # SIZE_MAX as the pickle holds it
    assert settings_alloc_conf(settings) == "expandable_segments:False"


def _workload(rec: RecordingSim, seed: int, skip: list[bool] | None = None) -> tuple[list[list[int]], list[bool]]:
    rng = random.Random(seed)
    live: list[int] = []
    marks: list[list[int]] = []
    released: list[bool] = []
    calls = 0
    for _ in range(1500):
        r = rng.random()
        if live and r < 0.45:
            rec.free(live.pop(rng.randrange(len(live))))
        elif r < 0.46:
            if skip is None or skip[calls]:
                before = len(rec.entries)
                rec.empty_cache()
                released.append(len(rec.entries) > before)
            calls += 1
        elif r < 0.47:
            marks.append(rec.snapshot())
        else:
            live.append(rec.malloc(_size(rng)))
    return marks, released


@pytest.mark.parametrize("recorded", ["", "expandable_segments:True", "max_split_size_mb:256"])
def test_a_recorded_history_replays_exactly_under_every_setting(recorded):
    rec = RecordingSim(recorded)
    marks, released = _workload(rec, 5)
    trace = read_trace(rec.dump())
    others = ["", "expandable_segments:True", "roundup_power2_divisions:4", "max_split_size_mb:256"]
    result = whatif(trace, others)
    assert result.reproduces_segment_events, result.segment_difference
    assert not result.incomplete
    assert result.replays[recorded].checkpoints == marks
    for other in others:
        # An empty_cache() that released nothing leaves no trace: the direct run skips those too.
        direct = RecordingSim(other)
        expected, _ = _workload(direct, 5, skip=released)
        assert result.replays[other].checkpoints == expected, other


def test_garbage_collection_frees_are_the_allocations_own():
    config = "per_process_memory_fraction:0.002,garbage_collection_threshold:0.5"  # 300 MB allowed
    rec = RecordingSim(config)
    rng = random.Random(2)
    live: list[int] = []
    for _ in range(600):
        if live and (len(live) > 6 or rng.random() < 0.5):
            rec.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(rec.malloc(rng.randint(10, 40) * MIB))
    rec.snapshot()
    assert rec.sim.num_device_free > 0  # garbage was collected
    result = whatif(read_trace(rec.dump()), [])
    assert result.reproduces_segment_events, result.segment_difference
    assert result.plan.empty_caches == 0
    assert OP_EMPTY_CACHE not in {op[0] for op in result.plan.ops}


def test_a_history_without_its_start_is_incomplete():
    rec = RecordingSim("")
    _workload(rec, 7)
    doc = rec.dump()
    doc["device_traces"][0] = doc["device_traces"][0][400:]  # the ring wrapped
    result = whatif(read_trace(doc), [])
    assert result.incomplete
    text = " ".join(result.incomplete)
    assert "never allocated" in text and "snapshot at the dump" in text


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config", ["", "expandable_segments:True"])
def test_forecast_is_the_launch_loop_on_the_seeded_state(mode, config):
    original, _ = _busy(config, 9)
    state = read_allocator_state(original.snapshot())
    shape = IndexerShape(layers=6, chunk=4096)
    result = forecast(state, shape, 60_000, mode=mode, alloc_conf=config)

    class Direct:  # the same loop on the original simulator
        name = "sim"

        def launch(self, rows: int, width: int, kv_len: int) -> object:
            return original.malloc(rows * width * 4)

        def alloc(self, nbytes: int) -> object:
            return original.malloc(nbytes)

        def release(self, allocation: object) -> None:
            original.free(allocation)  # type: ignore[arg-type]

    start = original.reserved_bytes
    allocs = original.num_device_alloc
    run_prefill(Direct(), shape, mode, 60_000)  # type: ignore[arg-type]
    assert result.reserved_growth_bytes == original.reserved_bytes - start
    assert result.num_device_alloc == original.num_device_alloc - allocs
    assert result.start.reserved_bytes == start
    assert sum(step.growth_bytes for step in result.growth_steps) == result.reserved_growth_bytes


def test_forecast_never_calls_the_hook_target(monkeypatch):
    import telemetry.model.indexer.launch as launch

    def hooked(*args, **kwargs):
        raise AssertionError("the forecast went through the hook target")

    monkeypatch.setattr(launch, "indexer_logits_launch", hooked)
    state = read_allocator_state(CachingAllocatorSim().snapshot())
    assert forecast(state, IndexerShape(layers=2), 40_000).reserved_growth_bytes > 0


def test_forecast_says_when_the_prefill_would_not_fit():
    sim = CachingAllocatorSim()
    sim.malloc(600 * MIB)
    state = read_allocator_state(sim.snapshot())
    result = forecast(state, IndexerShape(layers=4), 100_000, capacity_bytes=1024 * MIB)
    assert result.out_of_memory
    assert result.peak_reserved_bytes <= 1024 * MIB
    with pytest.raises(ValueError, match="positive integer"):
        forecast(state, IndexerShape(), 0)
