"""Samplers: the fixed metric names picked out of real exporter output (fixtures/metrics/).

daemon__2core-vm.txt: `memtel daemon` on this 2-core VM (its kernel log holds NV_ERR_NO_MEMORY and Xid
13/79 lines). hook__allocsim.txt and hook-calls__allocsim.jsonl: the hook's exporter and per-call log,
hooking a function that allocates through the lab's caching-allocator simulator (8 growing launches).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from harness.ab.records import ServerSnapshot
from harness.ab.report import CallSeries, growth_location
from harness.ab.samplers import node_snapshot, parse_metrics, rank_snapshot, server_snapshot
from telemetry.hook.call_log import read_call_log

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"


def test_node_snapshot_from_the_real_daemon():
    snap = node_snapshot(parse_metrics((FIXTURES / "daemon__2core-vm.txt").read_text()))
    assert snap.mem_available_bytes == 2.447212544e10
    assert snap.mem_total_bytes is not None and snap.mem_total_bytes > snap.mem_available_bytes
    assert snap.swap_used_bytes == 0 and snap.pswpin_total == 0 and snap.pswpout_total == 0
    assert snap.nv_err_no_memory_total == 1
    assert snap.xid_total == 2 and snap.xid_by_code == {"13": 1.0, "79": 1.0}


def test_rank_snapshot_from_the_real_hook_exporter():
    snap = rank_snapshot(parse_metrics((FIXTURES / "hook__allocsim.txt").read_text()))
    assert snap.reserved_bytes == snap.allocated_bytes == 1_207_959_552
    assert snap.num_device_alloc == 8 and snap.num_device_free == 0
    assert snap.hook_calls_total == 8 and snap.growth_events_total == 8
    assert snap.num_ooms == 0 and snap.host_mem_available_bytes is not None and snap.host_mem_available_bytes > 0


def test_absent_series_are_none_not_zero():
    daemon_text = (FIXTURES / "daemon__2core-vm.txt").read_text()
    assert set(dataclasses.asdict(rank_snapshot(parse_metrics(daemon_text))).values()) == {None}
    assert server_snapshot(parse_metrics(daemon_text)) == ServerSnapshot()


def test_server_snapshot_sums_over_labels():
    text = """# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 1.5
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 2.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="tiny"} 0.5
vllm:time_to_first_token_seconds_count{engine="1",model_name="tiny"} 1.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 0.0
"""
    snap = server_snapshot(parse_metrics(text))
    assert snap.ttft_sum_s == 2.0 and snap.ttft_count == 3.0 and snap.prefix_cache_hits_total == 0.0


def test_growth_location_on_the_real_per_call_log():
    records = read_call_log(FIXTURES / "hook-calls__allocsim.jsonl")
    assert len(records) == 8 and all(c.allocator is not None for c in records)
    reserved = [c.allocator.reserved_bytes for c in records if c.allocator is not None]
    calls = CallSeries.from_records(records)
    everything = growth_location(calls, records[0].ts, records[-1].ts)
    # The process's first call has no "before": its growth is unknown, not counted as 0.
    assert everything.first_call_growth_bytes is None
    assert everything.reserved_growth_bytes == reserved[-1] - reserved[0]
    assert everything.num_device_alloc == 7
    later = growth_location(calls, records[4].ts, records[-1].ts)
    assert later.calls == 4
    assert later.first_call_growth_bytes == reserved[4] - reserved[3]
    assert later.last_call_growth_bytes == reserved[7] - reserved[6]
