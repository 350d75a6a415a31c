"""The report from recorded runs: real results.jsonl files and hook logs of CPU vLLM runs (fixtures/).

The numbers are checked on the metrics dataclasses, computed from the records by hand here; the Markdown
is checked only for what it must show (sections in order, a caller's section, notes).
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
from pathlib import Path

import pytest

from harness.ab.records import RequestDone, Scrape, read_records
from harness.ab.report import (
    CallSeries,
    Report,
    RunDirectoryError,
    Section,
    Spread,
    compute_metrics,
    growth_location,
    load_run,
    write_report,
)
from harness.ab.report import markdown as md
from harness.ab.report.stats import Estimate, PairedDifference
from telemetry.allocator_counters import AllocatorCounters
from telemetry.hook.call_log import CallRecord, read_call_logs

FIXTURES = Path(__file__).parent / "fixtures"


def known(value: float | None) -> float:
    assert value is not None
    return value

REPEATS_RUN = FIXTURES / "cpu-vllm-repeats"  # two arms (url), repeats 2, node daemon, hook in the workers


@pytest.fixture
def run_dir(tmp_path):
    target = tmp_path / "run"
    shutil.copytree(REPEATS_RUN, target)
    return target


def test_request_metrics_from_a_recorded_run(run_dir):
    metrics = compute_metrics(load_run(run_dir))
    run = metrics.run
    assert run.arms == ["stock", "fixed"] and run.repeats == 2 and run.nodes == ["local"] and run.ranks == ["rank0"]
    records = read_records(run_dir / "results.jsonl")
    requests = [r for r in records if isinstance(r, RequestDone)]
    assert len(metrics.requests) == len(requests) == 2 * 2 * 3
    for req in requests:
        m = metrics.requests[(req.arm, req.repeat, req.step)]
        assert (m.ttft_client_s, m.ttft_server_s, m.prompt_tokens, m.usage_prompt_tokens) == (
            req.ttft_s, req.server_ttft_s, req.prompt_tokens, req.usage_prompt_tokens)
        scrapes = [s for s in records if isinstance(s, Scrape) and (s.arm, s.repeat) == (req.arm, req.repeat)]
        before = [s for s in scrapes if s.ts <= req.started_at][-1]
        after = next(s for s in scrapes if s.phase == "after" and s.step == req.step)
        available = known(after.nodes["local"].mem_available_bytes) - known(before.nodes["local"].mem_available_bytes)
        assert m.nodes["local"].mem_available_delta_bytes == available
        calls = known(after.ranks["rank0"].hook_calls_total) - known(before.ranks["rank0"].hook_calls_total)
        assert m.ranks["rank0"].hook_calls == calls
        assert m.ranks["rank0"].reserved_growth_bytes is None  # the CPU has no allocator: unknown, not 0
        # The hook's call log of rank 0: the calls inside the request, without an allocator.
        assert m.hook[0].calls > 0 and not m.hook[0].has_allocator
    assert metrics.failures == []
    assert set(metrics.cold_checked.values()) == {0.0}


def test_spreads_and_differences_over_repeats(run_dir):
    metrics = compute_metrics(load_run(run_dir))
    step = metrics.run.steps[0]
    stock = sorted(known(metrics.requests[("stock", r, step)].ttft_client_s) for r in (0, 1))
    assert metrics.spread("stock", step, lambda m: m.ttft_client_s) == Spread(statistics.median(stock), stock[0],
                                                                              stock[1], 2)
    difference = metrics.paired("stock", "fixed", step, lambda m: m.ttft_client_s)
    pairs = [known(metrics.requests[("stock", r, step)].ttft_client_s)
             - known(metrics.requests[("fixed", r, step)].ttft_client_s) for r in (0, 1)]
    assert difference.repeats == [0, 1] and difference.estimate == Estimate.of(pairs)


def test_difference_statement():
    def note(a, b):
        return md.difference(PairedDifference.of("a", "b", dict(enumerate(zip(a, b, strict=True)))), 1.0, " s")

    assert note([1.0, 1.2, 1.4], [1.1, 1.1, 1.5]) == "-0.0 s (within the noise)"
    assert note([1.0, 1.1, 1.2], [2.0, 2.1, 2.3]) == "-1.0 s (significant)"
    assert note([1.0, 1.1], [2.0, 2.1]) == "-1.0 s (significant)"  # the same difference in every repeat
    assert note([1.0, 1.1], [1.0, 1.1]) == "+0.0 s (no difference)"
    assert note([1.0], [2.0]) == "-1.0 s (one repeat: no noise estimate)"
    assert note([None], [2.0]) == "n/a"
    assert md.spread(Spread.of([1.0, 2.0, 4.0]), digits=1) == "2.0 [1.0–4.0]"


def test_growth_location_first_and_last_call(tmp_path):
    mib = 1 << 20
    lines = [{"ts": t, "call": i, "site": "s", "rank": 0, "pid": 1, "node": "n", "device": "sim",
              "reserved_bytes": r * mib, "allocated_bytes": 0, "num_device_alloc": a, "num_device_free": 0,
              "num_alloc_retries": 0, "num_ooms": 0, "mem_available_bytes": 1, "swap_free_bytes": 1}
             for i, (t, r, a) in enumerate([(1, 10, 1), (2, 12, 2), (3, 12, 2), (4, 20, 3), (5, 20, 3)])]
    (tmp_path / "memtel-calls-rank0-pid1.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    calls = CallSeries.from_records(read_call_logs(tmp_path)[0])
    loc = growth_location(calls, 1.5, 4.5)
    assert (loc.calls, loc.reserved_growth_bytes, loc.first_call_growth_bytes, loc.last_call_growth_bytes,
            loc.num_device_alloc, loc.has_allocator) == (3, 10 * mib, 2 * mib, 8 * mib, 2, True)
    assert growth_location(calls, 0.5, 1.5).first_call_growth_bytes is None  # a process's first call: unknown


def test_a_failed_and_a_missing_request_are_listed(run_dir):
    results = run_dir / "results.jsonl"
    records = [json.loads(line) for line in results.read_text().splitlines()]
    last = max(i for i, r in enumerate(records) if r["event"] == "request")
    dropped = records[last]
    results.write_text("".join(json.dumps(r) + "\n" for i, r in enumerate(records)
                               if i != last and r["event"] != "run_end"))
    metrics = compute_metrics(load_run(run_dir))
    assert metrics.run.status is None
    assert [(f.arm, f.repeat, f.step, f.kind) for f in metrics.failures] == [
        (dropped["arm"], dropped["repeat"], dropped["step"], "not run")]
    with results.open("a") as f:
        f.write(json.dumps(dict(dropped, ok=False, error="RemoteProtocolError: peer closed connection",
                                ttft_s=None)) + "\n")
    metrics = compute_metrics(load_run(run_dir))
    assert [(f.kind, f.reason) for f in metrics.failures] == [("failed", "RemoteProtocolError: peer closed connection")]
    report = write_report(run_dir).read_text()
    assert "status **unfinished**" in report
    assert f"- {dropped['arm']} repeat {dropped['repeat']} {dropped['step']}: failed: RemoteProtocolError" in report


def test_sections_in_order_with_a_callers_sections_and_notes(run_dir):
    report = Report.build(run_dir)
    lead = Section("lab", "About this run", "What ran.", placement="lead", data={"answer": 42})
    tail = Section("verdict", "Verdict", "Nothing to claim.", placement="tail")
    text = report.write([lead, tail], notes={"ttft": ["TTFT here is not the fix's effect."]}).read_text()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings == ["## About this run", "## 1. Allocator growth per rank", "## 2. Host MemAvailable per request",
                        "## 3. Time to first token per request", "## 4. Swap and driver errors per request",
                        "## 5. Differences between the arms", "## Failed and skipped requests", "## Verdict",
                        "## Plots"]
    ttft = text.split("## 3. Time to first token per request")[1].split("## 4.")[0]
    assert ttft.rstrip().endswith("TTFT here is not the fix's effect.")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["sections"]["lab"] == {"answer": 42}
    assert len(summary["requests"]) == 12 and summary["requests"][0]["nodes"]["local"]["mem_available_delta_bytes"]
    assert {"plots/mem_available_local.png", "plots/reserved_rank0.png", "plots/ttft.png"} == set(
        summary["sections"]["plots"])
    for plot in summary["sections"]["plots"]:
        data = (run_dir / plot).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    with pytest.raises(ValueError, match="repeated: lab"):
        report.write([lead, lead])


def test_device_allocs_are_never_called_cudamallocs_in_a_header(run_dir):
    text = write_report(run_dir).read_text()
    headers = [line for line in text.splitlines() if line.startswith("| rank |")]
    assert len(headers) == 2 and all("device allocs" in h and "cudaMalloc" not in h for h in headers)


def test_a_directory_without_a_run_is_a_clear_error(tmp_path):
    expected = r"results\.jsonl does not exist: not a run directory of `memtel ab run`"
    with pytest.raises(RunDirectoryError, match=expected):
        load_run(tmp_path)


def test_growth_location_on_columns_is_the_per_call_definition():
    """The columnar computation against the definition, call by call, on calls of two processes."""
    rng = random.Random(5)
    records, reserved, allocs = [], 0, 0
    for call in range(400):
        pid = 1 if call < 150 else 2  # a restarted server: its first call has no "before"
        reserved += rng.choice([0, 0, 0, 1 << 20, 20 << 20])
        allocs += rng.choice([0, 0, 1])
        allocator = None if call in (10, 11) else AllocatorCounters(reserved, 0, allocs, 0)
        records.append(CallRecord(100.0 + call, call, "s", 0, pid, "n", "sim", allocator, 1, 1, None))
    series = CallSeries.from_records(records)

    def growth(i: int, field: int) -> int | None:
        before, now = (records[i - 1] if i else None), records[i]
        if before is None or before.pid != now.pid or before.allocator is None or now.allocator is None:
            return None
        return now.allocator[field] - before.allocator[field]

    for start, end in ((95.0, 160.5), (100.0, 100.0), (109.5, 130.0), (150.0, 499.0), (600.0, 700.0)):
        inside = [i for i, r in enumerate(records) if start <= r.ts <= end]
        loc = growth_location(series, start, end)
        assert loc.calls == len(inside)
        if not inside or records[inside[0]].allocator is None:
            assert not loc.has_allocator
            continue
        known = [g for g in (growth(i, 0) for i in inside) if g is not None]
        allocs_known = [g for g in (growth(i, 2) for i in inside) if g is not None]
        assert (loc.reserved_growth_bytes, loc.num_device_alloc) == (sum(known) if known else None,
                                                                      sum(allocs_known) if allocs_known else None)
        assert (loc.first_call_growth_bytes, loc.last_call_growth_bytes) == (growth(inside[0], 0),
                                                                             growth(inside[-1], 0))


def test_a_long_series_is_plotted_with_its_peaks():
    values = [0] * 10_000
    values[7_777] = 5 << 30
    records = [CallRecord(float(i), i, "s", 0, 1, "n", "sim", AllocatorCounters(v, 0, 0, 0), 1, 1, None)
               for i, v in enumerate(values)]
    xs, ys = CallSeries.from_records(records).reserved_points(max_points=1000)
    assert len(xs) == len(ys) <= 1000 and int(ys.max()) == 5 << 30
