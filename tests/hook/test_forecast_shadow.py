"""The event shadow (telemetry/hook/forecast/shadow.py) and its event log's codec, on the CPU.

The events come from the simulator itself: a "real" allocator (CachingAllocatorSim with its device calls logged)
runs a workload and logs what c10's trace tracker logs (segment calls, then `alloc` at the block's address with
the requested bytes; `free_requested`, `free_completed`); a shadow seeded with the simulator's snapshot part-way
and given the rest of the log must end with the simulator's own state. A wrong address, a private pool, another
stream, an out-of-memory and hostile bytes stop it with a named reason or a clean error, never a wrong state.
"""

from __future__ import annotations

import random

import pytest

from telemetry.hook.forecast.shadow import Shadow, ShadowLost, after_marker
from telemetry.hook.forecast.snapshot_native.codec import torch_fields
from telemetry.hook.forecast.snapshot_native.events import Event, EventBytesError, decode_events, encode_events
from telemetry.model.allocsim.simulator import CachingAllocatorSim
from telemetry.model.allocsim.snapshot import read_allocator_state
from telemetry.model.allocsim.trace import ALLOC, FREE_COMPLETED, FREE_REQUESTED, OOM, SNAPSHOT

STREAM = 0x7F00
CODES = {"segment_alloc": 3, "segment_free": 4, "segment_map": 5, "segment_unmap": 6}
MiB = 1 << 20


class LoggedAllocator:
    """The simulator as the real allocator: every call it makes is logged as c10's tracker would see it."""

    def __init__(self, conf: str = "") -> None:
        self.sim = CachingAllocatorSim(conf)
        self.sim.device_calls = []
        self.events: list[Event] = []
        self.live: list[int] = []

    def _calls(self) -> None:
        calls = self.sim.device_calls
        assert calls is not None
        self.events += [Event(CODES[name], 0, address, size, STREAM, (0, 0)) for name, address, size in calls]
        calls.clear()

    def malloc(self, size: int) -> None:
        handle = self.sim.malloc(size)
        self._calls()
        address = self.sim.block_address(handle)
        self.events.append(Event(ALLOC, 0, address, size, STREAM, (0, 0)))
        self.live.append(handle)

    def free(self, index: int) -> None:
        handle = self.live.pop(index)
        address = self.sim.block_address(handle)
        self.events.append(Event(FREE_REQUESTED, 0, address, 0, STREAM, (0, 0)))
        self.sim.free(handle)
        self.events.append(Event(FREE_COMPLETED, 0, address, 0, STREAM, (0, 0)))

    def empty_cache(self) -> None:
        self.sim.empty_cache()
        self._calls()

    def snapshot(self) -> list[dict]:
        segments = self.sim.snapshot()
        for segment in segments:
            segment["stream"] = STREAM
        return segments


def workload(real: LoggedAllocator, rng: random.Random, steps: int) -> None:
    for _ in range(steps):
        roll = rng.random()
        if roll < 0.55 or not real.live:
            real.malloc(rng.choice([512, 4000, 300_000, 2 * MiB + 7, 9 * MiB, 25 * MiB, 130 * MiB]))
        elif roll < 0.97:
            real.free(rng.randrange(len(real.live)))
        else:
            real.empty_cache()


def same_state(shadow: Shadow, real: LoggedAllocator) -> bool:
    return bool(torch_fields(shadow.segments()) == torch_fields(real.snapshot())
                and read_allocator_state(shadow.segments()) == read_allocator_state(real.snapshot()))


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "max_split_size_mb:64",
                                  "roundup_power2_divisions:4"])
def test_a_replayed_simulator_log_reproduces_the_simulators_own_state(conf):
    rng = random.Random(7)
    real = LoggedAllocator(conf)
    workload(real, rng, 300)
    shadow = Shadow(real.snapshot(), 0, conf)
    real.events.clear()
    for _ in range(6):
        workload(real, rng, 150)
        shadow.apply(decode_events(encode_events(real.events)).events)   # through the bytes, as from the extension
        real.events.clear()
        assert same_state(shadow, real)
    assert shadow.replayed > 400
    assert sum(s["total_size"] for s in real.snapshot()) > 0


def coalesced_log(events: list[Event]) -> tuple[list[Event], int]:
    """The log as snapshot_native.cpp's `coalesce` leaves it (the rule written out again here, as the oracle): an
    ALLOC, FREE_REQUESTED, FREE_COMPLETED of one block with nothing in between, after a record that is not a
    segment call, is dropped."""
    out: list[Event] = []
    dropped = 0
    for event in events:
        if (event.action == FREE_COMPLETED and len(out) >= 3 and out[-1].action == FREE_REQUESTED
                and out[-2].action == ALLOC and out[-1].addr == out[-2].addr == event.addr
                and not 3 <= out[-3].action <= 6):
            del out[-2:]
            dropped += 1
            continue
        out.append(event)
    return out, dropped


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "max_split_size_mb:64"])
def test_a_block_allocated_and_freed_with_nothing_between_can_be_left_out_of_the_log(conf):
    """Why the extension may drop such pairs: the shadow replaying the shortened log ends in the allocator's own
    state, with pairs nested inside one another and pairs whose allocation made a segment (those stay)."""
    rng = random.Random(11)
    real = LoggedAllocator(conf)
    workload(real, rng, 200)
    shadow = Shadow(real.snapshot(), 0, conf)
    real.events.clear()
    sizes = [512, 4000, 300_000, 2 * MiB + 7, 9 * MiB, 25 * MiB, 130 * MiB, 700 * MiB]
    dropped_total = 0
    for _ in range(5):
        for _ in range(60):
            depth = rng.randint(1, 4)
            for _ in range(depth):       # a step's temporaries: made, then freed innermost first
                real.malloc(rng.choice(sizes))
            for _ in range(depth):
                real.free(len(real.live) - 1)
            if rng.random() < 0.3:
                workload(real, rng, 3)   # something that stays (or an empty_cache) between steps
        kept, dropped = coalesced_log(real.events)
        dropped_total += dropped
        shadow.apply(decode_events(encode_events(kept)).events)
        real.events.clear()
        assert same_state(shadow, real)
    assert dropped_total > 100


def test_no_pair_is_left_out_under_a_garbage_collection_threshold():
    from telemetry.hook.forecast.snapshot_native.reader import coalesce_pairs

    assert coalesce_pairs({})
    assert coalesce_pairs({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert not coalesce_pairs({"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6,max_split_size_mb:64"})
    assert not coalesce_pairs({"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.8"})


def test_frees_pending_on_another_stream_show_until_they_complete():
    real = LoggedAllocator()
    real.malloc(25 * MiB)
    real.malloc(4000)
    shadow = Shadow(real.snapshot(), 0, "")
    address = real.sim.block_address(real.live[0])
    shadow.apply([Event(FREE_REQUESTED, 0, address, 0, STREAM, (0, 0))])
    states = {b["address"]: b["state"] for s in shadow.segments() for b in s["blocks"]}
    assert states[address] == "active_pending_free"
    real.free(0)
    shadow.apply(real.events[-1:])
    assert same_state(shadow, real)


def test_an_allocation_elsewhere_than_the_allocators_stops_the_shadow():
    real = LoggedAllocator()
    real.malloc(25 * MiB)
    shadow = Shadow(real.snapshot(), 0, "")
    real.events.clear()
    real.malloc(4 * MiB)
    wrong = [e._replace(addr=e.addr + 512) if e.action == ALLOC else e for e in real.events]
    with pytest.raises(ShadowLost) as lost:
        shadow.apply(wrong)
    assert lost.value.reason == "mismatch"


def test_a_segment_the_simulator_would_not_have_made_stops_the_shadow():
    real = LoggedAllocator()
    real.malloc(25 * MiB)
    real.free(0)
    shadow = Shadow(real.snapshot(), 0, "")
    # The allocator took a new segment for 4 MiB although a cached 26 MiB one was free: not this allocator.
    events = [Event(3, 0, 0x9000_0000, 20 * MiB, STREAM, (0, 0)), Event(ALLOC, 0, 0x9000_0000, 4 * MiB, STREAM, (0, 0))]
    with pytest.raises(ShadowLost) as lost:
        shadow.apply(events)
    assert lost.value.reason == "mismatch"


@pytest.mark.parametrize(("event", "reason"), [
    (Event(ALLOC, 0, 0x1000, 512, STREAM, (1, 0)), "pool"),
    (Event(ALLOC, 0, 0x1000, 512, STREAM + 1, (0, 0)), "stream"),
    (Event(OOM, 0, 1 << 30, 1 << 40, STREAM, (0, 0)), "oom"),
    (Event(FREE_COMPLETED, 0, 0x1234, 0, STREAM, (0, 0)), "mismatch"),
])
def test_what_the_shadow_does_not_follow_is_named(event, reason):
    real = LoggedAllocator()
    real.malloc(25 * MiB)
    shadow = Shadow(real.snapshot(), 0, "")
    with pytest.raises(ShadowLost) as lost:
        shadow.apply([event])
    assert lost.value.reason == reason


def test_other_devices_and_other_snapshots_leave_the_shadow_alone():
    real = LoggedAllocator()
    real.malloc(25 * MiB)
    shadow = Shadow(real.snapshot(), 0, "")
    shadow.apply([Event(ALLOC, 1, 0x1000, 512, 99, (5, 5)), Event(SNAPSHOT, 0, 0, 0, 0, (0, 0))])
    assert same_state(shadow, real)


def test_the_full_snapshots_marker_splits_the_log():
    events = [Event(ALLOC, 0, 1, 512, 0, (0, 0)), Event(SNAPSHOT, 0, 0, 0, 0, (0, 0)),
              Event(SNAPSHOT, 1, 0, 0, 0, (0, 0)), Event(FREE_COMPLETED, 0, 1, 0, 0, (0, 0))]
    assert after_marker(events, 1) == events[3:]
    assert after_marker(events, 0) == events[2:]
    with pytest.raises(ShadowLost) as lost:
        after_marker(events, 2)
    assert lost.value.reason == "no_marker"


def test_an_event_logs_bytes_round_trip_with_flags():
    events = [Event(ALLOC, 3, 2**64 - 1, 5, 7, (1, 2))]
    log = decode_events(encode_events(events, overflowed=True, no_pool=True))
    assert log.events == events and log.overflowed and log.no_pool
    assert decode_events(encode_events([])).events == []


@pytest.mark.parametrize(("data", "words"), [
    (b"", "shorter than"),
    (b"XXXX" + bytes(12), "not an allocator event log"),
    (encode_events([])[:4] + (2).to_bytes(2, "little") + bytes(10), "format 2"),
    (encode_events([])[:6] + (8).to_bytes(2, "little") + bytes(8), "unknown flags"),
    (encode_events([Event(ALLOC, 0, 1, 1, 0, (0, 0))])[:-1], "takes 64 bytes"),
    (encode_events([Event(9, 0, 1, 1, 0, (0, 0))]), "unknown action 9"),
    (encode_events([])[:8] + (5 << 22).to_bytes(4, "little") + bytes(4), "over the"),
    ("text", "is bytes"),
])
def test_hostile_event_bytes_are_a_clean_error(data, words):
    with pytest.raises(EventBytesError, match=words):
        decode_events(data)


# ---- the forecast thread on the shadow (its helper process), with the extension played by the simulator -----------

class SimulatedExtension:
    """What the native extension gives the thread, from a LoggedAllocator: full snapshots (leaving their marker in
    the log, as c10's snapshot() does for the tracker) and the event log. A stand-in for the CUDA build, which runs
    on the GPU machine (test_forecast_shadow_gpu.py)."""

    FORMAT_VERSION = 1

    def __init__(self, real: LoggedAllocator) -> None:
        self.real = real
        self.snapshots = 0
        self.attached = 0

    def attach_events(self, cap: int, coalesce: bool = False) -> bool:
        self.attached += 1
        self.real.events.clear()
        return True

    def snapshot_bytes(self) -> bytes:
        from telemetry.hook.forecast.snapshot_native.codec import encode_snapshot

        self.snapshots += 1
        self.real.events.append(Event(SNAPSHOT, 0, 0, 0, 0, (0, 0)))
        return encode_snapshot(self.real.snapshot())

    def take_events(self) -> bytes:
        data = encode_events(self.real.events)
        self.real.events.clear()
        return data

    def detach_events(self) -> None:
        self.attached -= 1


@pytest.fixture
def shadowed(monkeypatch):
    from telemetry.fit_budget import set_forecast_budget
    from telemetry.hook.allocator import CudaAllocatorReader
    from telemetry.hook.forecast import set_forecast_workload
    from telemetry.hook.forecast.runner import Forecaster
    from telemetry.model.indexer.shape import IndexerShape

    class BoundReader(CudaAllocatorReader):
        bound_device = 0

        def snapshot(self):
            raise AssertionError("the thread took torch's snapshot: the native path was not used")

    shape = IndexerShape(layers=4, chunk=1024, compress_ratio=4, max_model_len=65536, logits_budget_bytes=64 * MiB)
    set_forecast_workload(shape)
    set_forecast_budget(lambda: 900 * MiB, reserve_mib=20)
    monkeypatch.setattr(Forecaster, "unavailable", lambda self: None)
    real = LoggedAllocator()
    rng = random.Random(3)
    workload(real, rng, 200)
    reader = BoundReader()
    live = Forecaster((4096,), 5.0, environ={}, reader=lambda: reader)
    extension = SimulatedExtension(real)
    live._native.module = extension
    yield live, real, extension, rng, shape
    live.stop()
    set_forecast_workload(None)
    set_forecast_budget(None)


def expected_forecast(real: LoggedAllocator, shape):
    from telemetry.model.indexer.forecast import forecast

    return forecast(read_allocator_state(real.snapshot()), shape, 4096, alloc_conf="")


def test_the_thread_takes_one_snapshot_then_follows_the_events(shadowed):
    live, real, extension, rng, shape = shadowed
    assert live.run_once(), live.results.failures
    assert extension.snapshots == 1 and extension.attached == 1
    assert live.results.resyncs == {"start": 1}
    for _ in range(3):
        workload(real, rng, 60)
        assert live.run_once(), live.results.failures
        assert live.results.forecasts[0] == expected_forecast(real, shape)
    assert live.run_once()                              # nothing happened: nothing sent, the forecast stands
    assert extension.snapshots == 1 and live.results.resyncs == {"start": 1}
    assert live.results.snapshot_reader == "native" and live.results.max_fit is not None


def test_a_lost_shadow_is_counted_and_the_same_cycle_takes_a_full_snapshot(shadowed):
    live, real, extension, rng, shape = shadowed
    assert live.run_once()
    real.malloc(25 * MiB)
    real.events[-1] = real.events[-1]._replace(addr=real.events[-1].addr + 4096)   # not where the simulator puts it
    assert live.run_once(), live.results.failures
    assert live.results.resyncs == {"start": 1, "mismatch": 1}
    assert extension.snapshots == 2
    assert live.results.forecasts[0] == expected_forecast(real, shape)   # from the full snapshot, exact
    workload(real, rng, 40)
    assert live.run_once() and extension.snapshots == 2                 # following again
    assert live.results.forecasts[0] == expected_forecast(real, shape)


def test_a_helper_that_died_loses_the_shadow_and_a_new_one_starts_from_a_full_snapshot(shadowed):
    live, real, extension, rng, shape = shadowed
    assert live.run_once()
    workload(real, rng, 20)
    helper = live._helper
    assert helper is not None and helper._process is not None
    helper._process.kill()
    helper._process.wait(5)
    assert live.run_once(), live.results.failures   # the new helper holds no shadow: a full snapshot, same cycle
    assert helper.starts == 2 and extension.snapshots == 2
    assert live.results.resyncs == {"start": 1, "lost": 1}
    assert live.results.forecasts[0] == expected_forecast(real, shape)


def test_overflowed_logs_and_shadow_off_take_full_snapshots():
    from telemetry.hook.forecast.snapshot_native.reader import NativeSnapshots

    off = NativeSnapshots({"MEMTEL_FORECAST_SHADOW": "off"})
    off.module = SimulatedExtension(LoggedAllocator())
    assert not off.events_on() and off.events_off == "MEMTEL_FORECAST_SHADOW='off'"
    bad = NativeSnapshots({"MEMTEL_FORECAST_SHADOW": "maybe"})
    bad.module = off.module
    assert not bad.events_on() and bad.module.attached == 0


def test_one_reader_takes_the_event_log_at_a_time_and_gives_it_back_when_stopped():
    from telemetry.hook.forecast.snapshot_native.reader import NativeSnapshots

    extension = SimulatedExtension(LoggedAllocator())
    first, second = NativeSnapshots({}), NativeSnapshots({})
    first.module = second.module = extension
    assert first.events_on() and extension.attached == 1
    assert not second.events_on() and "another live forecast" in (second.events_off or "")
    first.stop_events()
    assert extension.attached == 0 and not first.events_on() and first.events_off == "stopped"
    third = NativeSnapshots({})
    third.module = extension
    assert third.events_on() and extension.attached == 1
    third.stop_events()
