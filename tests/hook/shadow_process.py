"""One CUDA process for tests/hook/test_forecast_shadow_gpu.py (run as `python -m`, the allocator settings in
PYTORCH_CUDA_ALLOC_CONF): the event shadow against torch's snapshot, phase by phase, on messy states.

The native reader is loaded (built in the background or found in the cache) and its event log attached; the
shadow starts from a full native snapshot and the events after its marker. Each phase changes the allocator
(allocations and frees of many sizes, empty_cache, a free pending on another stream, allocations on another
stream, a private pool), then the shadow replays the phase's events and is compared with
`torch.cuda.memory_snapshot()` taken with no event between (the device's segments with the keys the simulator
reads, and `read_allocator_state`). Each phase's result: "equal", "resync:<reason>" (the shadow gave up and was
started again from a full snapshot, as the forecast thread does) or "WRONG" (the shadow replayed without
complaint to a state that is not torch's: the failure this test exists for). Last, the hook's forecast thread
with the shadow on: after a first cycle, allocations, then one more cycle, whose forecast must equal
`forecast()` on torch's snapshot. One JSON line.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

import torch

from telemetry.hook.forecast.shadow import Shadow, ShadowLost, after_marker
from telemetry.hook.forecast.snapshot_native.codec import decode_snapshot, torch_fields
from telemetry.hook.forecast.snapshot_native.events import decode_events
from telemetry.hook.forecast.snapshot_native.reader import NativeSnapshots, coalesced
from telemetry.model.allocsim.snapshot import read_allocator_state
from tests.hook.gpu_forecast import hooked_forecaster

MIB = 1 << 20
CONF = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")


def device_fields(segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(torch_fields([s for s in segments if s["device"] == 0]), key=lambda s: s["address"])


class Follower:
    def __init__(self, native: NativeSnapshots) -> None:
        self.native = native
        self.total = int(torch.cuda.get_device_properties(0).total_memory)
        self.shadow: Shadow | None = None
        self.resyncs: list[str] = []
        self.replayed = 0
        self.events = 0
        self.seed()

    def seed(self) -> None:
        snapshot = self.native.take()
        assert snapshot is not None
        log = decode_events(self.native.take_events())
        self.shadow = Shadow(decode_snapshot(snapshot), 0, CONF, self.total)
        self.shadow.apply(after_marker(log.events, 0))

    def step(self) -> str:
        """Replay what happened since the last step, compare with torch's snapshot; the phase's result."""
        torch.cuda.synchronize()
        for _ in range(5):
            data = self.native.take_events()
            python = torch.cuda.memory_snapshot()
            if decode_events(self.native.take_events()).events:   # something allocated meanwhile: again
                self.resyncs.append("busy")
                self.shadow = None
                continue
            log = decode_events(data)
            self.events += len(log.events)
            try:
                if self.shadow is None:
                    raise ShadowLost("unfollowed", "the last seed was refused")
                if log.overflowed:
                    raise ShadowLost("overflow", "dropped")
                self.shadow.apply(log.events)
            except ShadowLost as lost:
                self.resyncs.append(lost.reason)
                try:
                    self.seed()   # the state is torch's again (checked below like any other)
                except ShadowLost as refused:   # a state the simulator does not model (several streams)
                    self.shadow = None
                    return f"resync:{lost.reason}, refused:{refused.reason}"
                result = f"resync:{lost.reason}"
            else:
                result = "equal"
            shadow = self.shadow
            assert shadow is not None
            same = (device_fields(shadow.segments()) == device_fields(python)
                    and read_allocator_state(shadow.segments(), device=0) == read_allocator_state(python, device=0))
            self.replayed = shadow.replayed
            return result if same else f"WRONG ({result})"
        return "busy"


def phases(keep: list[Any], held: list[Any], rng: random.Random) -> list[tuple[str, Any]]:
    """The phases; `held` keeps what the mixing phases must not free (another stream's, a private pool's)."""
    sizes = [512, 100_000, 3 * MIB, 25 * MIB, 1_500_000, 7 * MIB, 64 * 1024, 30 * MIB, 2 * MIB + 1, 12 * MIB,
             130 * MIB]
    side = torch.cuda.Stream()

    def mix() -> None:
        for _ in range(400):
            if rng.random() < 0.55 or not keep:
                keep.append(torch.empty(rng.choice(sizes), dtype=torch.uint8, device="cuda"))
            else:
                keep.pop(rng.randrange(len(keep)))

    def steps() -> None:   # a step's temporaries, freed innermost first: the pairs the extension leaves out
        for _ in range(300):
            depth = rng.randint(1, 4)
            temporaries = [torch.empty(rng.choice(sizes), dtype=torch.uint8, device="cuda") for _ in range(depth)]
            while temporaries:
                temporaries.pop()

    def empty_cache() -> None:
        del keep[::2]
        torch.cuda.empty_cache()

    def pending() -> None:
        block = torch.empty(9 * MIB, dtype=torch.uint8, device="cuda")
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000_000)   # about 1 s on an H200: the free stays pending meanwhile
        block.record_stream(side)
        del block

    def completed() -> None:
        side.synchronize()
        keep.append(torch.empty(4000, dtype=torch.uint8, device="cuda"))   # a malloc completes pending frees

    def other_stream() -> None:
        with torch.cuda.stream(side):   # a segment of that stream, freed again: the state is one stream's again
            block = torch.empty(5 * MIB, dtype=torch.uint8, device="cuda")
        del block
        side.synchronize()
        torch.cuda.empty_cache()

    def private_pool() -> None:
        pool_type = getattr(torch.cuda, "MemPool", None)
        if pool_type is None:
            held.append(torch.empty(5 * MIB, dtype=torch.uint8, device="cuda"))
            return
        pool = pool_type()
        with torch.cuda.use_mem_pool(pool):
            held.append(torch.empty(5 * MIB, dtype=torch.uint8, device="cuda"))
        held.append(pool)

    return [("mix", mix), ("steps", steps), ("mix", mix), ("empty_cache", empty_cache), ("steps", steps),
            ("mix", mix), ("pending", pending),
            ("completed", completed), ("mix", mix), ("other_stream", other_stream), ("mix", mix),
            ("private_pool", private_pool), ("mix", mix), ("empty_cache", empty_cache), ("mix", mix)]


def main() -> int:
    torch.cuda.init()
    native = NativeSnapshots()
    started = time.monotonic()
    while native.take() is None and native.off is None and time.monotonic() - started < 600:
        time.sleep(0.2)
    if native.module is None or not native.events_on():
        print(json.dumps({"native": native.reader, "off": native.off, "events_off": native.events_off}))
        return 1
    keep: list[Any] = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in (25 * MIB, 3 * MIB, 4000)]
    follower = Follower(native)
    rng = random.Random(11)
    results = []
    held: list[Any] = []
    for name, phase in phases(keep, held, rng):
        phase()
        results.append([name, follower.step()])
    keep.clear()
    held.clear()
    torch.cuda.synchronize()
    native.stop_events()   # the forecast thread's reader takes the log next
    out: dict[str, Any] = {"phases": results, "resyncs": follower.resyncs, "events": follower.events,
                           "coalesced": coalesced(native.module),
                           "replayed_last": follower.replayed, "hook": hooked_forecast()}
    print(json.dumps(out))
    return 0


def hooked_forecast() -> dict[str, Any]:
    """The hook's forecast thread with the event shadow: its first cycle, then allocations, then one more cycle
    (run here while the thread waits out its interval), against `forecast()` on torch's snapshot."""
    from telemetry.model.indexer.forecast import forecast

    handle, forecaster, shape = hooked_forecaster(3600.0)
    first = forecaster.results
    held = [torch.empty(size, dtype=torch.uint8, device="cuda") for size in (40 * MIB, 7 * MIB, 300_000, 90 * MIB)]
    del held[1]
    torch.cuda.synchronize()
    ran = forecaster.run_once()
    results = forecaster.results
    expected = forecast(read_allocator_state(torch.cuda.memory_snapshot(), device=0), shape, 20000, alloc_conf=CONF)
    handle.uninstall()
    got = results.forecasts[0] if results.forecasts else None
    before = first.forecasts[0] if first.forecasts else None
    return {"ran": ran, "reader": results.snapshot_reader, "failures": results.failures,
            "resyncs": results.resyncs, "first_resyncs": first.resyncs,
            "changed": got is not None and before is not None and got.start != before.start,
            "equal": got is not None and (got.reserved_growth_bytes, got.peak_reserved_bytes, got.num_device_alloc,
                                          tuple(got.start)) == (expected.reserved_growth_bytes,
                                                                expected.peak_reserved_bytes,
                                                                expected.num_device_alloc, tuple(expected.start))}


if __name__ == "__main__":
    sys.exit(main())
