"""A process with a hooked function, scraped by the live Prometheus tests (test_live_prometheus.py).

    python -m tests.dashboards.live_hook_process --port PORT [--addr ADDR] [--seconds S] [--marker TEXT]
                                                 [--log-dir DIR]

It is a serving rank in miniature. `logits_chunk` (a function of this module) is hooked with
`telemetry.install`; the lab's caching-allocator simulator is the allocator source, as in
`memtel lab serve --allocator sim`.

It starts at rest: every call allocates the same float32 logits [rows, width] and frees it, so after
the first call the allocator reuses its cached block and nothing grows, nothing fails (a serving
process after warm-up). SIGUSR1 switches it to a growing prefill: the width grows call by call, like
the sparse indexer's logits, so the allocator keeps mapping new segments (growth events, reserved
deltas, device allocations all move), and two failure paths of the hook are exercised on purpose,
because dashboards and alerts read them: one install target that does not exist
(memtel_hook_install_failures_total) and an allocator read that fails on every 7th call
(memtel_hook_errors_total{stage="allocator"}).

The live forecast is on (a small indexer workload, every second) with the simulator's own snapshot, so the
forecast series (memtel_forecast_*) that the dashboards and MemtelPrefillWouldNotFit read exist. One lock
orders the hooked calls and the forecast thread's snapshots, as a real allocator's lock does.

The process exits after --seconds, or as soon as its parent is gone. `--marker` only appears on
the command line, so the daemon's process collector can match it as a serving role.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # main() imports it when it runs
    from telemetry.model.allocsim import CachingAllocatorSim

ROWS = 64
FLOAT32 = 4
REST_WIDTH = 1024
WIDTH_STEP = 4096                  # 1 MiB more logits per call while growing
MAX_LOGITS_BYTES = 256 << 20       # then empty_cache and start over, so the simulated pool stays bounded
MISSING_TARGET = "json:memtel_live_test_no_such_function"  # an existing module without that attribute
FAIL_EVERY = 7
FORECAST = {"forecast_tokens": (8000, 16000), "forecast_interval_s": 1.0,
            "forecast_shape": "layers=2,chunk=1024,max_model_len=16384,budget_mb=8"}


class _Storage:
    """What the hook's engine reader asks of a tensor's storage: its address and its bytes."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.address, self.size = address, nbytes

    def data_ptr(self) -> int:
        return self.address

    def nbytes(self) -> int:
        return self.size


class _Tensor:
    device = "sim"

    def __init__(self, address: int, nbytes: int) -> None:
        self.storage = _Storage(address, nbytes)

    def untyped_storage(self) -> _Storage:
        return self.storage


class _Model:
    def parameters(self) -> list[_Tensor]:
        return [_Tensor(1 << 30, 48 << 20), _Tensor(2 << 30, 16 << 20)]     # 64 MiB of "weights"


class _Runner:
    def __init__(self) -> None:
        self.model = _Model()
        self.kv_caches: list[_Tensor] = []


class Worker:
    """An engine worker in miniature: its model loads, then its KV cache is allocated (the hook's engine signals,
    as vLLM's Worker.load_model and Worker.initialize_from_config), so the ledger's series (memtel_engine_*) exist."""

    def __init__(self) -> None:
        self.model_runner = _Runner()

    def get_model(self) -> _Model:
        return self.model_runner.model

    def load_model(self) -> None:
        return None

    def initialize_from_config(self) -> None:
        self.model_runner.kv_caches = [_Tensor(4 << 30, 32 << 20)]     # 32 MiB of "KV cache"


def logits_chunk(allocator: CachingAllocatorSim, width: int) -> None:
    """One prefill chunk's logits: allocate [ROWS, width] float32 and free it (the cache keeps it)."""
    allocator.free(allocator.malloc(ROWS * width * FLOAT32))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="hook exporter port (local rank 0)")
    parser.add_argument("--addr", default="127.0.0.1", help="address the exporter binds")
    parser.add_argument("--seconds", type=float, default=300.0, help="stop after this long")
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between hooked calls")
    parser.add_argument("--marker", default="memtel-live-hook-process", help="text for the daemon to match")
    parser.add_argument("--log-dir", default=None, help="directory for the hook's per-call log")
    args = parser.parse_args(argv)

    import telemetry
    from telemetry.hook import set_allocator_source
    from telemetry.model.allocsim import CachingAllocatorSim

    simulator = CachingAllocatorSim()
    growing = False
    reads = 0

    def allocator_source() -> dict:
        nonlocal reads
        reads += 1
        if growing and reads % FAIL_EVERY == 0:
            raise RuntimeError("allocator statistics unreadable (injected by the live test)")
        return simulator.stats()

    def start_growing(_signum: int, _frame: object) -> None:
        nonlocal growing
        growing = True

    lock = threading.Lock()

    def allocator_snapshot() -> list:
        with lock:
            return simulator.snapshot()

    signal.signal(signal.SIGUSR1, start_growing)
    set_allocator_source(allocator_source, snapshot=allocator_snapshot)
    site = f"{__name__}:logits_chunk"
    options = {"port": args.port, "addr": args.addr, "log_dir": args.log_dir, **FORECAST,
               "model_loaded": (f"{__name__}:Worker.load_model",),
               "engine_memory": (f"{__name__}:Worker.initialize_from_config",)}
    handle = telemetry.install([site], **options)
    if site not in handle.installed:
        print(f"hook not installed: installed={handle.installed} failed={handle.failed}", file=sys.stderr)
        return 1

    worker = sys.modules[__name__].Worker()
    worker.load_model()               # the engine signals, looked up on the class at call time (patched)
    worker.initialize_from_config()
    parent = os.getppid()
    deadline = time.monotonic() + args.seconds
    width = REST_WIDTH
    missing_installed = False
    module = sys.modules[__name__]
    while time.monotonic() < deadline and os.getppid() == parent:
        if growing and not missing_installed:
            telemetry.install([MISSING_TARGET], **options)  # counted
            missing_installed = True
        with lock:
            # Looked up at call time, as the indexer's call site does: the hook's wrapper runs.
            module.logits_chunk(simulator, width)
            if growing:
                width += WIDTH_STEP
                if ROWS * width * FLOAT32 > MAX_LOGITS_BYTES:
                    simulator.empty_cache()  # a negative reserved delta on the next call
                    width = REST_WIDTH
        time.sleep(args.interval)
    handle.uninstall()
    return 0


if __name__ == "__main__":
    sys.exit(main())
