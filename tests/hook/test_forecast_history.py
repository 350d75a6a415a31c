"""The hook's allocation history (telemetry/hook/forecast/history.py): compaction that leaves every setting's
replayed state as the full history leaves it, its bound, what it gives up on, and /snapshot serving it."""

from __future__ import annotations

import json
import random

import pytest
from prometheus_client import CollectorRegistry

from telemetry.allocator_counters import AllocatorCounters
from telemetry.hook.exporter import snapshot_answer, start_exporter
from telemetry.hook.forecast.history import AllocationHistory, from_torch_trace, keep_history
from telemetry.model.fitsearch.history import history_from_ops, replay
from telemetry.model.fitsearch.rebuild import layout
from telemetry.model.indexer.prefill import LaunchPattern, run_prefill
from telemetry.model.indexer.shape import MIB, IndexerShape
from tests.support.cli import call_main

SHAPE = IndexerShape(layers=2, chunk=2048, compress_ratio=4, max_model_len=65_536, logits_budget_bytes=64 * MIB,
                     topk=256)


class Recording:
    """A launch backend that only records its allocations and frees, in full and into the hook's history."""

    name = "recording"

    def __init__(self, history: AllocationHistory) -> None:
        self.history = history
        self.full: list[list[int | str]] = []
        self.next = 0

    def alloc(self, nbytes: int) -> int:
        self.next += 1
        self.full.append(["a", self.next, nbytes])
        self.history.alloc(self.next, nbytes)
        return self.next

    def launch(self, rows: int, width: int, kv_len: int) -> int:
        return self.alloc(rows * width * 4)

    def release(self, key: object) -> None:
        assert isinstance(key, int)
        self.full.append(["f", key])
        self.history.free(key)

    def counters(self) -> AllocatorCounters:
        return AllocatorCounters(0, 0, 0, 0)

    def finish(self) -> None:
        """Nothing in flight."""

    def close(self) -> None:
        """Nothing held."""

    def describe(self) -> dict[str, object]:
        return {}


def serving(history: AllocationHistory, prefills: int = 60) -> Recording:
    """Resident blocks (weights, KV cache), a few freed, then prefills of lengths that often repeat."""
    backend = Recording(history)
    rnd = random.Random(7)
    resident = [backend.alloc(rnd.randrange(1, 300) * MIB) for _ in range(12)]
    for key in resident[::4]:
        backend.release(key)
    for _ in range(prefills):
        run_prefill(backend, SHAPE, "stock", rnd.choice((2048, 4096, 4096, 10_000)), pattern=LaunchPattern())
    return backend


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "max_split_size_mb:128",
                                  "roundup_power2_divisions:4",
                                  "garbage_collection_threshold:0.6,per_process_memory_fraction:0.02",
                                  "expandable_segments:True,garbage_collection_threshold:0.6,"
                                  "per_process_memory_fraction:0.02"])
def test_compaction_leaves_every_settings_state_as_the_full_history(conf: str) -> None:
    history = AllocationHistory()
    backend = serving(history)
    full, compacted = history_from_ops(backend.full), history_from_ops(history.ops())
    assert history.dropped > 0 and len(compacted.ops) < len(full.ops)
    a = replay(full, conf, total_memory=150_109_880_320)
    b = replay(compacted, conf, total_memory=150_109_880_320)
    assert layout(a.segments) == layout(b.segments)
    assert a.counters == b.counters


def test_a_history_over_its_bound_is_given_up_not_kept_wrong() -> None:
    history = AllocationHistory(max_ops=50)
    serving(history, prefills=3)
    assert history.lost is not None and "over 50 ops" in history.lost
    assert history.ops() is None


def test_a_free_it_never_saw_allocated_gives_the_history_up() -> None:
    history = AllocationHistory()
    history.alloc(1, 100)
    history.free(2)
    assert history.ops() is None and "never saw allocated" in (history.lost or "")


def test_torch_trace_entries_become_the_same_ops() -> None:
    entries = [{"action": "alloc", "addr": 0x1000, "size": 512}, {"action": "free_requested", "addr": 0x1000},
               {"action": "free_completed", "addr": 0x1000}, {"action": "segment_alloc", "addr": 0x1000,
                                                              "size": 2 * MIB},
               {"action": "alloc", "addr": 0x1000, "size": 1024}]
    assert from_torch_trace(entries).ops() == [["a", 0, 512], ["f", 0], ["a", 1, 1024]]


def test_snapshot_serves_the_history_beside_the_segments() -> None:
    history = AllocationHistory()
    backend = serving(history, prefills=4)
    state = replay(history_from_ops(history.ops()), "")
    segments = [{"device": 0, "address": s.address, "total_size": s.total_size, "stream": 0,
                 "segment_type": "small" if s.small else "large", "segment_pool_id": [0, 0],
                 "is_expandable": False,
                 "blocks": [{"address": b.address, "size": b.size, "state": b.state} for b in s.blocks]}
                for s in state.segments]
    keep_history(history)
    try:
        status, body, _ = snapshot_answer(lambda: (segments, None))
        doc = json.loads(body)
        assert status == 200 and doc["history"] == history.ops() and len(doc["segments"]) == len(segments)
        assert backend.full
        history.free(10**9)   # a free it never saw: given up
        status, body, _ = snapshot_answer(lambda: (segments, None))
        assert "never saw allocated" in json.loads(body)["history_lost"] and "history" not in json.loads(body)
    finally:
        keep_history(None)
    assert "history" not in json.loads(snapshot_answer(lambda: (segments, None))[1])


def test_tune_hook_replays_the_history_the_hook_serves() -> None:
    """`memtel tune --hook` against a hook exporter that serves a history: each setting from its replay (a
    history that does not lead to the served segments is refused, exit 2, one line)."""
    history = AllocationHistory()
    serving(history, prefills=6)
    ops = history.ops()
    assert ops is not None
    state = replay(history_from_ops(ops), "")
    segments = [{"device": 0, "address": s.address, "total_size": s.total_size, "stream": 0,
                 "segment_type": "small" if s.small else "large", "segment_pool_id": [0, 0],
                 "is_expandable": False,
                 "blocks": [{"address": b.address, "size": b.size, "state": b.state} for b in s.blocks]}
                for s in state.segments]
    served = AllocationHistory()
    for op in ops:
        served.alloc(int(op[1]), int(op[2])) if op[0] == "a" else served.free(int(op[1]))
    keep_history(served)
    server = start_exporter(CollectorRegistry(), "127.0.0.1", 0, snapshot=lambda: (segments, 0))
    try:
        argv = ["tune", "--hook", f"127.0.0.1:{server.port}", "--target-tokens", "8192", "--memory-gb", "2",
                "--layers", "2", "--chunk", "2048", "--max-model-len", "65536", "--budget-mb", "64", "--topk",
                "256", "--expandable-segments", "True,False", "--max-split-mb", "none", "--roundup", "none",
                "--budgets-mb", "64", "--chunks", "2048", "--modes", "stock", "--json"]
        done = call_main(argv)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["history_ops"] == len(ops)
        assert not any(o["best_case"] for o in json.loads(done.stdout)["ranked"])
        served.alloc(-1, 4096)   # one more live allocation than the served segments hold
        done = call_main(argv)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        keep_history(None)
        done = call_main(argv)   # a hook without a history: the snapshot alone, layout changes a best case
        assert done.returncode == 0, done.stderr
        doc = json.loads(done.stdout)
        assert doc["history_ops"] is None
        assert all(o["best_case"] == ("expandable" in o["setting"]["alloc_conf"]) for o in doc["ranked"])
    finally:
        keep_history(None)
        server.stop()


def test_a_stopped_forecast_is_no_longer_served() -> None:
    """/snapshot serves the live forecast's last fit only while that forecast runs (a later hook in the same
    process, or none, must not be answered with it)."""
    from telemetry.hook.forecast import published
    from telemetry.hook.forecast.runner import Forecaster

    forecaster = Forecaster((4096,), 5.0, environ={}, helper=False)
    forecaster.start()
    try:
        assert published._provider is not None and published._owner is forecaster
    finally:
        forecaster.stop()
    assert published._provider is None and published.published() is None


def test_a_recorded_cuda_history_is_served_with_its_empty_cache_calls() -> None:
    """What /snapshot serves under MEMTEL_HOOK_HISTORY=1 (torch's recorder), from a real H200 trace with two
    empty_cache() calls under a GC threshold: replayed under its settings, it ends where the process did."""
    from pathlib import Path

    from telemetry.hook.forecast.history import torch_history
    from telemetry.model.allocsim.snapshot_file import read_snapshot_file
    from telemetry.model.allocsim.trace import load_trace

    path = (Path(__file__).resolve().parents[1] / "fixtures" / "allocator-gc-traces" / "h200-torch2.11"
            / "gc-a-gc0.5-x1.11-conf-ec2.5.pickle.gz")
    doc = read_snapshot_file(path, 2**30, 10**7)

    class Memory:
        @staticmethod
        def _snapshot() -> object:
            return doc

    class Cuda:
        memory = Memory

    class Torch:
        cuda = Cuda

    ops, lost = torch_history(Torch, 0)
    assert lost is None and ops is not None and ["e"] in ops
    trace = load_trace(path)
    assert trace.final is not None
    assert replay(history_from_ops(ops), trace.effective_conf).counters == trace.final.counters
