"""The lab's ranks in `memtel ledger` / `top` (issue 30): its hook reads the simulator through an allocator
source (set_allocator_source), yet the ledger showed its row as all `?` (pid and reserved too): the engine series,
which carry the pid and the allocator's reserved bytes, were left out for any process without a CUDA device or a
loaded model. A process that gives the hook its allocator is an engine: its series are exported and read back."""

from __future__ import annotations

import os

from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from telemetry.allocator_counters import AllocatorCounters
from telemetry.hook import set_allocator_source
from telemetry.hook.engine import EngineCollector, EngineTracker
from telemetry.hook.state import HookState
from telemetry.ledger.scrape import Scrape, hook_view
from telemetry.scrape import parse_body


def test_a_rank_on_the_labs_simulator_has_its_pid_and_reserved_bytes_in_the_ledger():
    counters = AllocatorCounters(reserved_bytes=96 << 20, allocated_bytes=64 << 20, num_device_alloc=3,
                                 num_device_free=1)
    state = HookState(node="vm", targets={})
    state.previous = counters   # the last hooked call's reading of the source
    registry = CollectorRegistry()
    registry.register(EngineCollector(EngineTracker(), state))
    set_allocator_source(lambda: counters)
    try:
        body = generate_latest(registry)
    finally:
        set_allocator_source(None)
    view = hook_view(Scrape("http://127.0.0.1:9200/metrics", parse_body(body)), None)
    process = view.process
    assert process is not None and view.node_label == "vm"
    assert (process.rank, process.pid) == ("0", str(os.getpid()))
    assert (process.reserved, process.allocated, process.allocator_cache) == (96 << 20, 64 << 20, 32 << 20)
