"""`memtel ab run` against the lab server (simulator, hook on): the 32k→1M ladder end to end with a resume in
the middle, A/A and A/B with repeats, and the exit codes of runs that cannot pass.

The 1M ladder is configs/ladders/long-context-32k-1m.yaml's steps and request settings, served by lab servers
with max-model-len 1,048,576 (the reference shape otherwise: 45 layers, 8,192-token chunks), byte-scaled 0.05 and
time-scaled 0: no modeled time is slept, a prefill takes what the simulator and the hook take (a few seconds at
1M here; nothing here asserts on TTFT). The fixed arm's 1M request makes 87,930 hooked calls; its block's call
log (~57 MB) rotates and compresses, and the report reads it back.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

import pytest
import yaml

from harness.ab.serve import group_members
from telemetry.model.indexer.planner import plan_prefill
from telemetry.model.indexer.shape import IndexerShape
from tests.ab.lab import ROOT, events, harness, lab_arm, node_daemon, records, run_ab, run_ab_together, tail, wait_for

pytestmark = pytest.mark.slow  # each test runs `memtel ab run` with lab servers

LONG_LADDER = ROOT / "configs" / "ladders" / "long-context-32k-1m.yaml"
MIB = 1 << 20


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with node_daemon(tmp_path_factory.mktemp("daemon")) as url:
        yield url


def expected_calls(mode: str, tokens: int, shape: IndexerShape) -> int:
    return sum(len(launches) for _, launches in plan_prefill(tokens, shape, mode)) * shape.layers


def sigterm_pending(pid: int) -> bool:
    """Whether a SIGTERM waits for the (stopped) process `pid`: /proc/PID/status's ShdPnd mask."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return False
    pending = int(next(line.split()[1] for line in lines if line.startswith("ShdPnd:")), 16)
    return bool(pending & (1 << (signal.SIGTERM - 1)))


def test_long_context_ladder_to_1m_resumed_in_the_middle(tmp_path, daemon):
    profile = yaml.safe_load(LONG_LADDER.read_text())
    steps = profile["steps"]
    assert [s["tokens"] for s in steps] == [32_000, 64_000, 128_000, 256_000, 512_000, 1_000_000]
    big = {"max_model_len": 1_048_576, "chunk": 8192, "layers": 45, "budget_mb": "512", "scale": "0.05",
           "time_scale": "0"}
    ladder = {"model": "lab", "request": {**profile["request"], "check_answer": False},
              "arms": [lab_arm("stock", "stock", **big), lab_arm("fixed", "fixed", **big)],
              "nodes": {"local": daemon}, "steps": steps, "repeats": 1, "order": "ABAB",
              # The profile's gate (no NV_ERR lines) would also count other tests' kernel-log lines on a shared
              # box: a deterministic gate instead. The fixed arm reuses its first request's blocks: 0 growth.
              "gates": [{"arm": "fixed", "step": "cold-1m", "max_reserved_growth_mib": 1}]}
    path = tmp_path / "ladder.yaml"
    path.write_text(yaml.safe_dump(ladder, sort_keys=False))
    run_dir, log = tmp_path / "run", tmp_path / "harness.log"

    # 1. Interrupt during the stock arm's 512k request: four steps of the block are done. As soon as the harness
    # samples the node for that request (it has scraped the server and sends the prompt), the server process is
    # stopped (SIGSTOP), so the request cannot finish however fast the prefill is; it runs on (SIGCONT) once the
    # harness, interrupted, is stopping it (its SIGTERM pending), and exits.
    proc = harness(["run", str(path), "--out", str(run_dir)], log)
    frozen = None
    try:
        wait_for(lambda: events(run_dir, "node_sample", arm="stock", step="cold-512k"), 240, "stock's 512k request",
                 proc, log)
        frozen = events(run_dir, "serve_start", arm="stock")[-1]["pid"]
        os.kill(frozen, signal.SIGSTOP)
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: sigterm_pending(frozen) or proc.poll() is not None, 60, "the harness to stop the server")
        with contextlib.suppress(ProcessLookupError):  # the harness may have had to SIGKILL it after its grace
            os.kill(frozen, signal.SIGCONT)
        assert proc.wait(timeout=60) == 130, tail(log)
    finally:
        if frozen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    first = [(r["arm"], r["step"]) for r in events(run_dir, "request")]
    assert first == [("stock", s["label"]) for s in steps[:4]]

    # 2. Resume: the unfinished block runs again from its first step, on a fresh server.
    result = run_ab(["run", str(path), "--out", str(run_dir), "--resume"], timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Verdict: PASS — 1 of 1 gates pass; 12 of 12 requests ok" in result.stdout

    recs = records(run_dir)
    superseded = [r for r in recs if r["event"] == "block_superseded"]
    assert [(s["arm"], s["repeat"], s["steps"]) for s in superseded] == [
        ("stock", 0, [s["label"] for s in steps[:4]])]
    cut = recs.index(superseded[0])
    current = [r for r in recs[cut:] if r["event"] == "request"]
    assert sorted((r["arm"], r["step"]) for r in current) == sorted(
        (a, s["label"]) for a in ("stock", "fixed") for s in steps)
    for r in current:
        assert r["ok"] and r["usage_prompt_tokens"] == r["prompt_tokens"] == r["target_tokens"], r
        assert r["prefix_cache_hit_tokens"] == 0  # every prefill cold
    assert [s["arm"] for s in events(run_dir, "serve_start")] == ["stock", "stock", "fixed"]
    # Prompts: built once (kept across the resume), each in a bounded number of /tokenize calls.
    prompts = events(run_dir, "prompt")
    assert len(prompts) == 6 and all(p["tokenize_calls"] <= 3 for p in prompts)
    million = next(p for p in prompts if p["step"] == "cold-1m")
    assert million["prompt_tokens"] == 1_000_000 and million["tokenize_s"] > 0
    ends = events(run_dir, "run_end")
    assert [e["status"] for e in ends] == ["interrupted", "complete"]
    assert ends[-1]["cpu_s"] > 0 and ends[-1]["max_rss_bytes"] > 10 * MIB

    # The hook's logs: the fixed block's ~57 MB rotated into a compressed segment; both attempts of the stock
    # block wrote into its directory, and only the second one counts.
    fixed_logs = sorted(p.name for p in (run_dir / "hook-logs" / "fixed-r0").iterdir())
    assert any(name.endswith(".0001.jsonl.gz") for name in fixed_logs), fixed_logs
    stock_pids = {p.name.split("-pid")[1].split(".")[0] for p in (run_dir / "hook-logs" / "stock-r0").iterdir()}
    assert len(stock_pids) == 2

    summary = json.loads((run_dir / "summary.json").read_text())
    shape = IndexerShape(max_model_len=1_048_576)
    growth = {(g["arm"], g["step"]): g for g in summary["sections"]["allocator"]["hook_growth"]}
    for arm in ("stock", "fixed"):
        for s in steps:
            assert growth[(arm, s["label"])]["hooked_calls"] == expected_calls(arm, s["tokens"], shape), (arm, s)
    assert growth[("fixed", "cold-1m")]["hooked_calls"] == 87_930
    assert isinstance(growth[("stock", "cold-32k")]["reserved_growth_bytes"], int)  # numbers, not text
    assert summary["verdict"]["exit_code"] == 0 and summary["harness"]["tokenize_calls"] == 6
    assert summary["sections"]["history"]["superseded"][0]["steps"] == [s["label"] for s in steps[:4]]
    report = (run_dir / "report.md").read_text()
    lines = report.splitlines()
    assert lines[2].startswith("**Verdict: PASS**")
    assert "## Run history" in report and "stock repeat 0: resumed: the block had not finished (4 of 6 steps " \
        "done); it runs again from its first step on a fresh server" in report
    assert "Harness: " in report and "peak RSS" in report
    assert f"MEMTEL_LOG_DIR={run_dir.resolve()}/hook-logs/stock-r0" in report  # the template, expanded
    assert "the arms made different numbers of them" in report and "more, narrower launches" in report
    for s in steps:
        assert f"| {s['label']} | local |" in report
    assert " r0 " not in report


def test_a_a_comes_out_no_difference_and_a_b_significant(tmp_path, daemon):
    # Per request and rank (the simulator is exact): stock grows 102 then 292 MiB, fixed 104 then 0.
    steps = [{"label": "cold-32k", "tokens": 32000, "seed": 1}, {"label": "cold-64k", "tokens": 64000, "seed": 2}]
    shape = {"chunk": 8192, "layers": 4, "max_model_len": 204800, "budget_mb": "512", "scale": "0.1"}

    def ladder(arms: list[dict], gates: list | None = None) -> Path:
        data = {"model": "lab", "request": {"max_tokens": 4, "check_answer": False}, "arms": arms,
                "nodes": {"local": daemon}, "steps": steps, "repeats": 2, "sample_interval_s": 0.2}
        if gates:
            data["gates"] = gates
        path = tmp_path / f"{arms[0]['name']}-{arms[1]['name']}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    # A/A: two identical stock arms; A/B: stock against fixed, with a gate the stock arm fails. The two runs are
    # independent (their own servers and ports): they run at the same time.
    aa, ab = run_ab_together([
        ["run", str(ladder([lab_arm("stock", "stock", **shape), lab_arm("stock-again", "stock", **shape)])),
         "--out", str(tmp_path / "aa")],
        ["run", str(ladder([lab_arm("stock", "stock", **shape), lab_arm("fixed", "fixed", **shape)],
                           gates=[{"arm": "fixed", "max_reserved_growth_mib": 200},
                                  {"arm": "stock", "max_reserved_growth_mib": 200}])),
         "--out", str(tmp_path / "ab")]])
    assert aa.returncode == 0, aa.stdout[-3000:] + aa.stderr[-3000:]
    assert ("stock − stock-again reserved growth over the ladder, all ranks: no difference (identical in all 2 "
            "repeats)") in aa.stdout
    stats = json.loads((tmp_path / "aa" / "summary.json").read_text())["sections"]["statistics"]
    growth = [c for c in stats["comparisons"] if c["metric"] == "reserved_growth_bytes"]
    assert len(growth) == 3 and all(c["differences"][0]["verdict"] == "no difference" for c in growth)
    assert [c["arms"]["stock"]["mean"] for c in growth] == [102 * MIB, 292 * MIB, 394 * MIB]
    ttft = [c for c in stats["comparisons"] if c["metric"] == "ttft_client_s"]
    assert all(c["differences"][0]["estimate"]["low"] is not None for c in ttft)  # an interval for every step
    # ABAB: the two arms of a repeat ran side by side.
    order = [(r["arm"], r["repeat"]) for r in events(tmp_path / "aa", "serve_start")]
    assert order == [("stock", 0), ("stock-again", 0), ("stock", 1), ("stock-again", 1)]

    # A/B: the gate on the stock arm fails: exit 3.
    assert ab.returncode == 3, ab.stdout[-3000:] + ab.stderr[-3000:]
    assert "Verdict: GATE FAILED — 1 of 2 gates failed: max_reserved_growth_mib 200 (arm stock)" in ab.stdout
    assert ("stock − fixed reserved growth over the ladder, all ranks: +290.0 MiB (significant: the same in all 2 "
            "repeats)") in ab.stdout
    stats = json.loads((tmp_path / "ab" / "summary.json").read_text())["sections"]["statistics"]
    over = next(c for c in stats["comparisons"]
                if c["metric"] == "reserved_growth_bytes" and c["step"] == "over the ladder")
    assert over["differences"][0]["verdict"] == "significant"
    assert over["differences"][0]["estimate"]["mean"] == 290 * MIB


def test_a_step_longer_than_max_model_len_stops_before_the_first_request(tmp_path):
    data = {"model": "lab", "request": {"max_tokens": 4, "check_answer": False},
            "arms": [lab_arm("stock", "stock", max_model_len=8192)],
            "steps": [{"label": "fits", "tokens": 4000, "seed": 1}, {"label": "too-long", "tokens": 9000, "seed": 2}]}
    path = tmp_path / "ladder.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    result = run_ab(["run", str(path), "--out", str(tmp_path / "run")], timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert (f"{path}: steps[1] (too-long): 9,000 tokens do not fit arm stock's server, whose max_model_len is 8,192"
            in result.stderr)
    run_dir = tmp_path / "run"
    assert not events(run_dir, "request") and not events(run_dir, "prompt")  # found before any work
    assert events(run_dir, "serve_stop") and events(run_dir, "run_end")[-1]["status"] == "error"


def test_failed_requests_exit_4_and_no_arm_started_exits_1(tmp_path):
    steps = [{"label": "a", "tokens": 2000, "seed": 1}, {"label": "b", "tokens": 2000, "seed": 2}]
    # The lab server refuses n=2 (HTTP 400): every request fails; the arm stops after the first.
    data = {"model": "lab", "request": {"max_tokens": 4, "check_answer": False, "extra_body": {"n": 2}},
            "arms": [lab_arm("stock", "stock")], "steps": steps}
    fails = tmp_path / "fails.yaml"
    fails.write_text(yaml.safe_dump(data, sort_keys=False))
    # No arm starts (the command exits at once): nothing ran. The two runs are independent: run at the same time.
    data["arms"][0]["serve"]["command"] = ["python3", "-c", "raise SystemExit(3)"]
    nothing = tmp_path / "nothing.yaml"
    nothing.write_text(yaml.safe_dump(data, sort_keys=False))
    result, none_ran = run_ab_together([["run", str(fails), "--out", str(tmp_path / "fails")],
                                        ["run", str(nothing), "--out", str(tmp_path / "nothing")]], timeout=120)
    assert result.returncode == 4, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Verdict: REQUESTS FAILED — 0 of 2 requests ok, 2 failed or skipped" in result.stdout
    report = (tmp_path / "fails" / "report.md").read_text()
    assert "- stock repeat 0 a: failed: HTTP 400" in report and "- stock repeat 0 b: skipped: request failed" in report
    assert none_ran.returncode == 1, none_ran.stdout[-2000:] + none_ran.stderr[-2000:]
    assert "Verdict: NOTHING RAN — no request was made (every arm failed to start)" in none_ran.stdout


def test_a_server_killed_mid_request_continue_serves_again_and_stop_arm_skips(tmp_path, daemon):
    """A served arm's server SIGKILLed during a prefill, once in an arm that goes on (`on_error: continue`, so a
    fresh serve runs the rest) and once in one that stops (`stop-arm`). The harness treats a lab server and a vLLM
    server alike here (a process group that dies); lab servers make the three starts cost seconds, not minutes."""
    # time-scale 4: the 40k prefill sleeps four times its modeled time (about 5 s), to be killed in flight.
    slow = {"max_model_len": 49152, "time_scale": "4"}
    arms = [lab_arm("goes-on", "stock", **slow), lab_arm("stops", "stock", **slow)]
    arms[0]["on_error"], arms[1]["on_error"] = "continue", "stop-arm"
    for arm in arms:
        del arm["ranks"]
    steps = [{"label": "small", "tokens": 2000, "seed": 1}, {"label": "long", "tokens": 40000, "seed": 2},
             {"label": "after", "tokens": 2000, "seed": 3}]
    ladder = {"model": "lab", "request": {"max_tokens": 4, "timeout_s": 120, "check_answer": False},
              "arms": arms, "nodes": {"local": daemon}, "steps": steps, "sample_interval_s": 0.5}
    ladder_path, run_dir, log = tmp_path / "ladder.yaml", tmp_path / "run", tmp_path / "harness.log"
    ladder_path.write_text(yaml.safe_dump(ladder, sort_keys=False))
    proc = harness(["run", str(ladder_path), "--out", str(run_dir)], log)
    try:
        for arm in ("goes-on", "stops"):
            def in_flight(arm: str = arm) -> bool:
                """The long prefill is in flight once the 0.5 s node sampler has recorded for it."""
                return bool(events(run_dir, "node_sample", arm=arm, step="long"))

            wait_for(in_flight, 120, f"{arm}'s long request", proc, log)
            os.killpg(events(run_dir, "serve_start", arm=arm)[-1]["pgid"], signal.SIGKILL)
        assert proc.wait(timeout=120) == 4, tail(log)  # requests failed: exit 4 (docs/harness.md)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    requests = {(r["arm"], r["step"]): r for r in events(run_dir, "request")}
    for arm in ("goes-on", "stops"):
        assert requests[(arm, "small")]["ok"]
        failed = requests[(arm, "long")]
        assert not failed["ok"] and failed["error"], failed
    # continue: a fresh serve ran the rest; stop-arm: the rest is skipped, with the reason.
    assert requests[("goes-on", "after")]["ok"]
    assert [s["arm"] for s in events(run_dir, "serve_start")] == ["goes-on", "goes-on", "stops"]
    assert ("stops", "after") not in requests
    skipped = events(run_dir, "step_skipped", arm="stops")
    assert [s["step"] for s in skipped] == ["after"] and "server died at step long" in skipped[0]["reason"]
    assert events(run_dir, "arm_stopped", arm="stops")
    assert not events(run_dir, "arm_stopped", arm="goes-on")
    assert all(not group_members(s["pgid"]) for s in events(run_dir, "serve_start"))  # every server group gone
    report = (run_dir / "report.md").read_text()
    assert "- goes-on repeat 0 long: failed:" in report and "- stops repeat 0 after: skipped: server died" in report
    assert "goes-on repeat 0: 2 servers in one attempt" in report  # the restart is said, not hidden


def test_a_sigkilled_harness_leaves_no_server_running_and_resume_runs_the_block_again(tmp_path, daemon):
    """The harness SIGKILLed during the second arm's block: nothing in it runs, and its watchdog (a process of
    its own) stops the server it left; --resume then runs that block again from its first step on a fresh server.
    The harness is stopped (SIGSTOP) right after the block's first request, so it is killed in the middle of the
    block however fast the lab answers."""
    small = {"max_model_len": 16384, "chunk": 2048, "budget_mb": "16"}
    arms = [lab_arm("stock", "stock", **small), lab_arm("fixed", "fixed", **small)]
    steps = [{"label": f"s{n}", "tokens": 2000 + 1000 * n, "seed": n} for n in range(1, 4)]
    ladder = {"model": "lab", "request": {"max_tokens": 4, "check_answer": False}, "arms": arms,
              "nodes": {"local": daemon}, "steps": steps}
    path, run_dir, log = tmp_path / "ladder.yaml", tmp_path / "run", tmp_path / "harness.log"
    path.write_text(yaml.safe_dump(ladder, sort_keys=False))
    proc = harness(["run", str(path), "--out", str(run_dir)], log)
    try:
        wait_for(lambda: events(run_dir, "request", arm="fixed"), 120, "fixed's first request", proc, log)
        os.kill(proc.pid, signal.SIGSTOP)
        fixed = events(run_dir, "serve_start", arm="fixed")[-1]
        assert group_members(fixed["pgid"]), "the server must still run for the case to be tested"
        proc.kill()
        proc.wait(timeout=30)
        wait_for(lambda: not group_members(fixed["pgid"]), 60, "the watchdog to stop the orphaned server")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not events(run_dir, "run_end")   # the killed harness wrote nothing more
    done = [r["step"] for r in events(run_dir, "request", arm="fixed")]
    assert done and len(done) < len(steps)

    result = run_ab(["run", str(path), "--out", str(run_dir), "--resume"], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    recs = records(run_dir)
    superseded = [(r["arm"], r["steps"]) for r in recs if r["event"] == "block_superseded"]
    assert superseded == [("fixed", done)]
    cut = next(i for i, r in enumerate(recs) if r["event"] == "block_superseded")
    requests = [(r["arm"], r["step"], r["ok"]) for r in recs[cut:] if r["event"] == "request"]
    assert requests == [("fixed", s["label"], True) for s in steps]   # the whole block again; stock's kept
    assert [s["arm"] for s in events(run_dir, "serve_start")] == ["stock", "fixed", "fixed"]
    assert all(not group_members(s["pgid"]) for s in events(run_dir, "serve_start"))
    assert [e["status"] for e in events(run_dir, "run_end")] == ["complete"]
    assert "fixed repeat 0: resumed: the block had not finished" in (run_dir / "report.md").read_text()
