"""The A/B harness against real vLLM CPU servers, the real node daemon and the hook in the workers.

`test_two_arms_interrupted_twice_then_resumed`: two served arms, 4k/4k/8k; Ctrl-C (SIGINT) during arm A,
--resume, SIGKILL of the harness during arm B (its watchdog must stop the server), --resume again; each
unfinished block runs again from its first step on a fresh server (its first attempt's records superseded);
then every record, exact prompt token counts, the report and plots. A server killed in the middle of a request
is tested with lab servers (tests/ab/test_lab_ladder.py): the harness treats both alike, and vLLM's three
starts there cost minutes.

Server starts are most of the cost (docs/testing.md), so each is made cheap:
- Each server runs eager (`--enforce-eager`: compiling is not what these tests check) in two processes, not
  three (`VLLM_ENABLE_V1_MULTIPROCESSING=0` with `--distributed-executor-backend uni`: the worker runs inside
  the engine core; the API server still starts the engine core as its own process). Nothing here asserts on
  the process layout: a server is its process group, stopped, killed and checked as a group.
- The harness is started without a `preexec_fn`, by a bootstrap that restores Ctrl-C itself
  (`harness_process`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from harness.ab.serve import group_members
from tests.ab.lab import events, records, tail, wait_for
from tests.ab.lab import node_daemon as run_node_daemon
from tests.support.ports import free_port
from tests.support.vllm import server_env, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
# A function that runs once per attention layer in the CPU worker (eager custom op, also under torch.compile).
HOOK_TARGET = "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward"


def group_gone(pgid: int) -> bool:
    """No live process of the group is left. A zombie is not counted: it runs nothing, and one whose parent
    exited first waits for init to reap it (the multiprocessing resource tracker of vLLM's API server), which
    neither the harness nor the server can hurry."""
    return not group_members(pgid)


def port_free(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


def serve_arm(name: str, model: Path, port: int, hook_port: int | None = None, on_error: str | None = None,
              max_model_len: int = 16384) -> dict:
    env = {k: v for k, v in server_env().items() if k not in os.environ or os.environ[k] != v}
    env["VLLM_SPARSE_INDEXER_FIXED_LOGITS_WIDTH"] = "1" if name.startswith("fixed") else "0"
    if hook_port is not None:
        env.update({"MEMTEL_TARGETS": HOOK_TARGET, "MEMTEL_PORT": str(hook_port), "MEMTEL_ADDR": "127.0.0.1"})
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # lets `uni` run the worker inside the engine core
    arm = {"name": name, "serve": {
        "command": [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                    "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
                    "--max-model-len", str(max_model_len), "--dtype", "float32", "--enforce-eager",
                    "--distributed-executor-backend", "uni"],
        "env": env, "health_url": f"http://127.0.0.1:{port}/health", "startup_timeout_s": 300, "stop_grace_s": 10,
    }}
    if on_error:
        arm["on_error"] = on_error
    return arm


# `memtel ab` with Ctrl-C as at a terminal: a suite started in the background runs with SIGINT ignored, and
# Python keeps an ignored SIGINT ignored.
_WITH_CTRL_C = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                "runpy.run_module('telemetry', run_name='__main__', alter_sys=True)")


def harness_process(args: list[str], log: Path) -> subprocess.Popen:
    """`memtel ab ARGS` as a child, its output in `log` (tests/ab/lab.py's `harness`, without a preexec_fn)."""
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-c", _WITH_CTRL_C, "ab", *args], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def node_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real memtel node daemon on a free loopback port."""
    with run_node_daemon(tmp_path_factory.mktemp("daemon-state")) as url:
        yield url


def test_two_arms_interrupted_twice_then_resumed(tmp_path: Path, tiny_model: Path, node_daemon: str) -> None:
    port_a, port_b, hook_port = free_port(), free_port(), free_port()
    ladder = {
        "model": "tiny",
        "request": {"max_tokens": 8, "timeout_s": 300, "check_answer": False,
                    "words_file": str(tiny_model / "tokenizer.json")},
        "arms": [serve_arm("stock", tiny_model, port_a, hook_port), serve_arm("fixed", tiny_model, port_b, hook_port)],
        "nodes": {"local": node_daemon},
        "ranks": {"rank0": f"http://127.0.0.1:{hook_port}/metrics"},
        "steps": [{"label": "cold-4k", "tokens": 4000, "seed": 1}, {"label": "cold-4k-b", "tokens": 4000, "seed": 2},
                  {"label": "cold-8k", "tokens": 8000, "seed": 3}],
        "repeats": 1, "order": "ABAB",
    }
    ladder_path = tmp_path / "ladder.yaml"
    ladder_path.write_text(yaml.safe_dump(ladder, sort_keys=False))
    run_dir, log = tmp_path / "run", tmp_path / "harness.log"
    procs: list[subprocess.Popen] = []
    try:
        # 1. Ctrl-C during arm A, after its first request: exit 130, server stopped, run_end interrupted.
        proc = harness_process(["run", str(ladder_path), "--out", str(run_dir)], log)
        procs.append(proc)
        # After the request's "after" scrape (its record comes first): a signal between the two would leave
        # the request without one, which is not what this test is about.
        wait_for(lambda: events(run_dir, "scrape", arm="stock", phase="after"), 240, "stock's first request", proc,
                 log)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130, tail(log)
        first_pgid = events(run_dir, "serve_start")[0]["pgid"]
        assert group_gone(first_pgid) and port_free(port_a)
        assert events(run_dir, "serve_stop", pgid=first_pgid)
        assert events(run_dir, "run_end")[-1]["status"] == "interrupted"
        done_before = [(r["arm"], r["step"]) for r in events(run_dir, "request")]
        assert ("stock", "cold-4k") in done_before

        # A finished-or-not run directory is never overwritten by accident.
        refused = subprocess.run([sys.executable, "-m", "telemetry", "ab", "run", str(ladder_path), "--out",
                                  str(run_dir)],
                                 cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and "already holds a run" in refused.stderr

        # 2. Resume, then SIGKILL the harness during arm B: nothing in it runs, its watchdog stops the server.
        proc = harness_process(["run", str(ladder_path), "--out", str(run_dir), "--resume"], log)
        procs.append(proc)
        wait_for(lambda: events(run_dir, "scrape", arm="fixed", phase="after"), 300, "fixed's first request", proc,
                 log)
        proc.kill()
        proc.wait(timeout=30)
        fixed_pgid = events(run_dir, "serve_start", arm="fixed")[-1]["pgid"]
        wait_for(lambda: group_gone(fixed_pgid) and port_free(port_b), 60, "the watchdog to stop the orphaned server")
        done_mid = [(r["arm"], r["step"]) for r in events(run_dir, "request")]

        # 3. Resume to the end, with the report.
        proc = harness_process(["run", str(ladder_path), "--out", str(run_dir), "--resume"], log)
        procs.append(proc)
        assert proc.wait(timeout=400) == 0, tail(log)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    # What each resume superseded: the stock steps done before the Ctrl-C, the fixed ones before the SIGKILL.
    check_complete_run(run_dir, ladder_path, {"stock": [s for a, s in done_before if a == "stock"],
                                              "fixed": [s for a, s in done_mid if a == "fixed"]})


def current(recs: list[dict]) -> list[dict]:
    """The records that count: a block's records before its last block_superseded record are left out."""
    last = {(r["arm"], r["repeat"]): i for i, r in enumerate(recs) if r["event"] == "block_superseded"}
    return [r for i, r in enumerate(recs)
            if r["event"] in ("prompt", "run_start", "run_end", "serve_stop")
            or "arm" not in r or i > last.get((r["arm"], r.get("repeat")), -1)]


def check_complete_run(run_dir: Path, ladder_path: Path, superseded_steps: dict[str, list[str]]) -> None:
    all_recs = records(run_dir)
    # Each interrupted block ran again from its first step: its first attempt is superseded, not mixed in.
    superseded = [(r["arm"], r["steps"]) for r in all_recs if r["event"] == "block_superseded"]
    assert superseded == [("stock", superseded_steps["stock"]), ("fixed", superseded_steps["fixed"])]
    recs = current(all_recs)
    requests = [r for r in recs if r["event"] == "request"]
    keys = [(r["arm"], r["step"]) for r in requests]
    # Every step exactly once among the records that count, each block from one uninterrupted serve.
    assert sorted(keys) == sorted((a, s) for a in ("stock", "fixed") for s in ("cold-4k", "cold-4k-b", "cold-8k"))
    for r in requests:
        assert r["ok"], r
        assert r["usage_prompt_tokens"] == r["prompt_tokens"] == r["target_tokens"], r  # exact, by the server's usage
        assert r["prompt_tokens_match"] is True
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert r["server_ttft_s"] is not None and r["server_ttft_s"] > 0
        assert r["output_tokens"] and r["output_tokens"] >= 1
        assert r["needle_found"] is None  # check_answer: false
        assert r["prefix_cache_hit_tokens"] == 0, r  # every prefill cold: no prompt shares a cached block
        assert r["node_samples"] >= 1 and r["min_mem_available_bytes"]["local"] > 0
    by_step: dict[str, set[str]] = {}
    for r in requests:  # both arms got the same prompt for a step
        by_step.setdefault(r["step"], set()).add(r["prompt_sha256"])
    assert all(len(shas) == 1 for shas in by_step.values()) and len({s for v in by_step.values() for s in v}) == 3
    prompts = [r for r in recs if r["event"] == "prompt"]
    assert len({(p["step"], p["repeat"]) for p in prompts}) == 3 and all(p["tokenize_calls"] <= 3 for p in prompts)
    # One fresh serve per (arm, segment): stock, stock resumed, fixed, fixed resumed; every one stopped.
    starts = [r for r in all_recs if r["event"] == "serve_start"]
    assert [s["arm"] for s in starts] == ["stock", "stock", "fixed", "fixed"]
    assert all(group_gone(s["pgid"]) for s in starts)
    assert [r["status"] for r in recs if r["event"] == "run_end"] == ["interrupted", "complete"]
    infos = [r for r in recs if r["event"] == "server_info"]
    assert all(i["version"]["version"] for i in infos) and all(i["rank_errors"] == {} for i in infos)
    run_start = next(r for r in recs if r["event"] == "run_start")
    assert run_start["environment"]["memtel_version"] and run_start["ladder_text"] == ladder_path.read_text()
    # Telemetry: the node daemon before the first and after each request, the hook's rank exporter too.
    scrapes = [r for r in recs if r["event"] == "scrape"]
    assert len([s for s in scrapes if s["phase"] == "after"]) == 6
    assert len([s for s in scrapes if s["phase"] == "baseline"]) == 2
    for s in scrapes:
        assert s["nodes"]["local"]["mem_available_bytes"] > 0, s
        assert s["ranks"]["rank0"]["error"] is None, s  # the hook's exporter answered, before a request too
        assert s["server"]["ttft_count"] is not None
    after = [s for s in scrapes if s["phase"] == "after"]
    assert all(s["ranks"]["rank0"]["hook_calls_total"] > 0 for s in after)
    # The baseline is the server before its first request: its hooked calls (none yet, eager vLLM does not warm
    # up; no series until the first call) are fewer than after that request.
    for i, s in enumerate(scrapes):
        if s["phase"] == "baseline":
            first = scrapes[i + 1]
            assert first["phase"] == "after" and first["arm"] == s["arm"], first
            assert (s["ranks"]["rank0"]["hook_calls_total"] or 0) < first["ranks"]["rank0"]["hook_calls_total"], s
    hook_logs = sorted((run_dir / "hook-logs").glob("*/memtel-calls-rank0-pid*.jsonl"))
    assert {p.parent.name for p in hook_logs} == {"stock-r0", "fixed-r0"}
    # The report: four tables with a row per step, plots, summary.
    report = (run_dir / "report.md").read_text()
    for heading in ("## 1. Allocator growth per rank", "## 2. Host MemAvailable per request",
                    "## 3. Time to first token per request", "## 4. Swap and driver errors per request"):
        assert heading in report
    for step in ("cold-4k", "cold-4k-b", "cold-8k"):
        assert f"| {step} | local |" in report
    assert "| cold-8k | 8,000 (exact) |" in report
    assert "| rank0 | stock |" in report and "| rank0 | fixed |" in report
    assert "None: every request of every arm completed." in report
    assert "## Run history" in report and "stock repeat 0: resumed: the block had not finished" in report
    assert "Prefix cache: 0 hit tokens in all 6 requests: every prefill was cold." in report
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(summary["requests"]) == 6 and summary["status"] == "complete"
    plots = summary["sections"]["plots"]
    for plot in plots:
        assert (run_dir / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"plots/mem_available_local.png", "plots/ttft.png", "plots/reserved_rank0.png"} <= set(plots)
