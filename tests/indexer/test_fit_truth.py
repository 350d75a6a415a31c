"""The simulator's out-of-memory under a per-process memory cap, against the H200 (both allocator modes).

tests/fixtures/fit/h200-torch2.11-cap-1.1gib.json is what benchmarks/fit_gpu.py recorded on an H200 (torch
2.11): one allocator state built the same way in a fresh process per length, under
`per_process_memory_fraction` (about 1.1 GiB of the device), with the defaults and with expandable segments;
for lengths around the boundary and across the range, whether the real prefill ran out of memory and its peak
reserved. From the recorded snapshot, the simulator must say the same of every length, and the search must
find the recorded boundary (the longest prefill that fits fits on the device; one token more does not).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from telemetry.model.allocsim.snapshot import read_allocator_state
from telemetry.model.indexer.fit import max_prefill_tokens
from telemetry.model.indexer.forecast import forecast
from telemetry.model.indexer.shape import IndexerShape

TRUTH = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "fit" /
                    "h200-torch2.11-cap-1.1gib.json").read_text())


@pytest.mark.parametrize("mode", ["default", "expandable"])
def test_every_recorded_length_runs_out_of_memory_exactly_where_the_device_did(mode):
    case = TRUTH["confs"][mode]
    shape = IndexerShape(**TRUTH["shape"])
    state = read_allocator_state(case["snapshot"], device=0)
    assert state.counters.reserved_bytes == case["start_reserved"]
    limit, total = case["max_fit"]["limit_bytes"], TRUTH["device_total"]
    outcomes = set()
    for row in case["rows"]:
        real = row["real"]
        simulated = forecast(state, shape, row["tokens"], alloc_conf=case["conf"], capacity_bytes=limit,
                             total_memory=total)
        assert simulated.out_of_memory == real["out_of_memory"], row
        if not real["out_of_memory"]:
            assert simulated.peak_reserved_bytes == real["peak_reserved"], row
        outcomes.add(real["out_of_memory"])
    assert outcomes == {True, False}   # the recorded lengths straddle the boundary


@pytest.mark.parametrize("mode", ["default", "expandable"])
def test_the_search_finds_the_devices_boundary(mode):
    case = TRUTH["confs"][mode]
    state = read_allocator_state(case["snapshot"], device=0)
    found = max_prefill_tokens(state, IndexerShape(**TRUTH["shape"]), limit_bytes=case["max_fit"]["limit_bytes"],
                               alloc_conf=case["conf"], total_memory=TRUTH["device_total"])
    real = {row["tokens"]: row["real"]["out_of_memory"] for row in case["rows"]}
    assert real[found.tokens] is False and real[found.tokens + 1] is True
    assert found.tokens == case["max_fit"]["tokens"]
