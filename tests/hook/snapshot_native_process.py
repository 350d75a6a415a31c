"""One CUDA process for tests/hook/test_forecast_snapshot_native_gpu.py (run as `python -m`, the allocator settings
in PYTORCH_CUDA_ALLOC_CONF): a messy allocator state, then the native snapshot reader against torch's.

The state: blocks of many sizes (small pool, split large segments, whole segments), some freed; a block freed
while another stream still uses it (active_pending_free, kept so by a 2 s kernel on that stream); a private
pool's segment (`torch.cuda.MemPool`, where this torch has it). Then, with nothing allocated between them: the
native reader's bytes, `torch.cuda.memory_snapshot()`, the bytes again (taken again until the two bytes agree:
the pending free may complete). Printed as one JSON line: what was compared and what the states hold. Last, the
hook's live forecast (helper process) on this state: which reader it used and its forecast against one
computed here from torch's snapshot.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from telemetry.hook.forecast.snapshot_native.codec import decode_snapshot, torch_fields
from telemetry.hook.forecast.snapshot_native.reader import NativeSnapshots
from telemetry.model.allocsim.snapshot import AllocatorState, SnapshotError, read_allocator_state
from tests.hook.gpu_forecast import hooked_forecaster

MIB = 1 << 20


def messy_state(keep: list[object]) -> None:
    sizes = [512, 100_000, 3 * MIB, 25 * MIB, 1_500_000, 7 * MIB, 64 * 1024, 30 * MIB, 2 * MIB + 1, 12 * MIB]
    blocks = [torch.empty(size, dtype=torch.uint8, device="cuda") for size in sizes * 3]
    keep += blocks[::3] + blocks[1::3]      # a third freed: cached, split or whole
    side = torch.cuda.Stream()
    pending = torch.empty(9 * MIB, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(4_000_000_000)   # about 2 s on an H200: the block stays pending that long
    pending.record_stream(side)
    del pending
    pool_type = getattr(torch.cuda, "MemPool", None)
    if pool_type is not None:
        pool = pool_type()
        with torch.cuda.use_mem_pool(pool):
            keep.append(torch.empty(5 * MIB, dtype=torch.uint8, device="cuda"))
        keep.append(pool)


def read(doc: object) -> AllocatorState | str:
    try:
        return read_allocator_state(doc, device=0, source="s")
    except SnapshotError as error:
        return f"SnapshotError: {error}"


def main() -> int:
    keep: list[object] = []
    torch.cuda.init()
    native = NativeSnapshots()
    started = time.monotonic()
    while native.take() is None and native.off is None and time.monotonic() - started < 600:
        time.sleep(0.2)
    if native.module is None:
        print(json.dumps({"native": None, "off": native.off}))
        return 1
    messy_state(keep)
    attempts, first, second = 0, b"", None
    while first != second and attempts < 5:
        attempts += 1
        first = native.take() or b""
        python = torch.cuda.memory_snapshot()
        second = native.take()
    decoded = decode_snapshot(first)
    state = read(decoded)
    out = {"native": native.reader, "attempts": attempts, "bytes": len(first), "segments": len(decoded),
           "decoded_equals_torch": decoded == torch_fields(python),
           "state_equals_torch": state == read(python),
           "state": state if isinstance(state, str) else {
               "segments": len(state.segments), "private": len(state.private_segments),
               "pending_free_bytes": state.pending_free_bytes, "live_blocks": state.live_blocks(),
               "expandable": sum(1 for s in state.segments if s.expandable),
               "blocks": sum(len(s.blocks) for s in state.segments)}}
    torch.cuda.synchronize()
    out["hook"] = hooked_forecast()
    print(json.dumps(out))
    return 0


def hooked_forecast() -> dict[str, object]:
    """The hook's live forecast on this process's allocator (helper process): its reader and its forecast, and
    `forecast()` on torch's snapshot taken right after."""
    from telemetry.model.indexer.forecast import forecast

    handle, forecaster, shape = hooked_forecaster(1.0)
    results = forecaster.results
    expected = forecast(read_allocator_state(torch.cuda.memory_snapshot(), device=0), shape, 20000,
                        alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    handle.uninstall()
    got = results.forecasts[0] if results.forecasts else None
    return {"reader": results.snapshot_reader, "failures": results.failures,
            "helper_cpu_seconds": results.helper_cpu_seconds,
            "equal": got is not None and (got.reserved_growth_bytes, got.peak_reserved_bytes, got.num_device_alloc)
            == (expected.reserved_growth_bytes, expected.peak_reserved_bytes, expected.num_device_alloc)}


if __name__ == "__main__":
    sys.exit(main())
