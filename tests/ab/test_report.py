"""The report from recorded runs: real results.jsonl files and hook logs of CPU vLLM runs (fixtures/)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness.ab.report import _spread_note, growth_location, load_run, write_report

FIXTURES = Path(__file__).parent / "fixtures"
REPEATS_RUN = FIXTURES / "cpu-vllm-repeats"  # two arms (url), repeats 2, node daemon, hook in the workers


@pytest.fixture
def run_dir(tmp_path):
    target = tmp_path / "run"
    shutil.copytree(REPEATS_RUN, target)
    return target


def table(report: str, heading: str) -> list[list[str]]:
    """The rows of the first table after a heading, as lists of cells."""
    lines = report.split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_report_tables_from_a_recorded_run(run_dir):
    report = write_report(run_dir).read_text()
    run = load_run(run_dir)
    assert run.arms == ["stock", "fixed"] and run.repeats == 2
    ttft = table(report, "## 3. Time to first token per request")
    header, rows = ttft[0], ttft[2:2 + len(run.steps)]
    assert header[:3] == ["step", "prompt tokens (usage)", "stock: TTFT client (s)"]
    assert [r[0] for r in rows] == run.steps
    for row, step in zip(rows, run.steps):
        tokens = {r["prompt_token_count"] for r in (run.requests[(a, rep, step)] for a in run.arms for rep in (0, 1))}
        assert row[1] == f"{tokens.pop():,} (exact)"
        # Two repeats: every measured cell is `median [min–max]`, computed from the records.
        values = sorted(run.requests[("stock", rep, step)]["ttft_s"] for rep in (0, 1))
        assert row[2] == f"{sum(values) / 2:,.3f} [{values[0]:,.3f}–{values[1]:,.3f}]"
        assert row[5] == "n/a"  # needle: the random-weight model cannot answer
    mem = table(report, "## 2. Host MemAvailable per request")
    assert [r[:2] for r in mem[2:]] == [[s, "local"] for s in run.steps]
    assert all("[" in cell and "–" in cell for r in mem[2:] for cell in r[2:6])
    swap = table(report, "## 4. Swap and driver errors per request")
    assert [r[:2] for r in swap[2:]] == [[s, "local"] for s in run.steps]
    growth = table(report, "## 1. Allocator growth per rank")
    assert [r[:2] for r in growth[2:]] == [["rank0", "stock"], ["rank0", "fixed"]]
    location = table(report, "### Where the growth happened")
    assert len(location) - 2 == len(run.arms) * run.repeats * len(run.steps)
    assert all(int(r[4]) > 0 for r in location[2:])  # hooked calls inside every request's window
    assert "None: every request of every arm completed." in report


def test_summary_and_plots(run_dir):
    write_report(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(summary["requests"]) == 2 * 2 * len(summary["steps"])
    first = summary["requests"][0]
    assert {"ttft_client_s", "ttft_server_s", "nodes", "ranks"} <= set(first)
    assert first["nodes"]["local"]["mem_available_delta_bytes"] is not None
    assert first["ranks"]["rank0"]["hook_calls"] > 0
    assert {"plots/mem_available_local.png", "plots/reserved_rank0.png", "plots/ttft.png"} <= set(summary["plots"])
    for plot in summary["plots"]:
        data = (run_dir / plot).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_a_failed_and_a_missing_request_are_listed(run_dir):
    results = run_dir / "results.jsonl"
    lines = results.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    last = max(i for i, r in enumerate(records) if r["event"] == "request")
    failed = dict(records[last], ok=False, error="RemoteProtocolError: peer closed connection", ttft_s=None)
    dropped = records[last]
    kept = [json.dumps(r) for i, r in enumerate(records) if i != last and r["event"] != "run_end"]
    results.write_text("\n".join(kept) + "\n")
    report = write_report(run_dir).read_text()
    assert f"- {dropped['arm']} r{dropped['repeat']} {dropped['step']}: not run yet" in report
    assert "status **unfinished**" in report
    with results.open("a") as f:
        f.write(json.dumps(failed) + "\n")
    report = write_report(run_dir).read_text()
    assert f"- {failed['arm']} r{failed['repeat']} {failed['step']}: failed: RemoteProtocolError" in report


def test_spread_statement():
    assert _spread_note([1.0, 1.2, 1.4], [1.1, 1.3, 1.5], 1.0, " s") == "-0.1 s (inside the spread)"
    assert _spread_note([1.0, 1.1, 1.2], [2.0, 2.1, 2.2], 1.0, " s") == "-1.0 s"
    assert _spread_note([1.0], [2.0], 1.0, " s") == "-1.0 s"  # one repeat: no spread to compare with
    assert _spread_note([], [2.0], 1.0, " s") == "n/a"


def test_growth_location_first_and_last_call():
    mib = 1 << 20
    calls = [{"ts": t, "pid": 1, "reserved_bytes": r * mib, "num_device_alloc": a}
             for t, r, a in [(1, 10, 1), (2, 12, 2), (3, 12, 2), (4, 20, 3), (5, 20, 3)]]
    loc = growth_location(calls, 1.5, 4.5)
    assert loc == {"calls": 3, "reserved_growth_bytes": 10 * mib, "first_call_growth_bytes": 2 * mib,
                   "last_call_growth_bytes": 8 * mib, "device_allocs": 2, "has_allocator": True}
    no_allocator = growth_location([{"ts": 2, "pid": 1}], 1, 3)
    assert no_allocator["calls"] == 1 and not no_allocator["has_allocator"]
