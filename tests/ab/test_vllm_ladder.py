"""The A/B harness against real vLLM CPU servers, the real node daemon and the hook in the workers.

`test_two_vllm_arms_run_to_a_complete_report_with_the_hook_and_the_daemon`: two served arms, 4k/4k/8k, run to
the end; then every record, exact prompt token counts (by the server's usage), the daemon's and the hook's
scrapes around each request, the hook's call logs, the report and plots. What happens when a run is interrupted
(Ctrl-C and --resume, the harness SIGKILLed and its watchdog stopping the server, a server killed in the middle
of a request) is the harness's own behaviour, the same for any served command: it is tested with lab servers
(tests/ab/test_lab_ladder.py, tests/ab/test_hostile_ladders.py), where a start costs a second, not 40.

Server starts are most of the cost (docs/testing.md), so each is made cheap: each server runs eager
(`--enforce-eager`: compiling is not what this test checks) in two processes, not three
(`VLLM_ENABLE_V1_MULTIPROCESSING=0` with `--distributed-executor-backend uni`: the worker runs inside the engine
core; the API server still starts the engine core as its own process). Nothing here asserts on the process
layout: a server is its process group, stopped and checked as a group.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from harness.ab.serve import group_members
from tests.ab.lab import events, records, run_ab
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


@pytest.fixture(scope="module")
def node_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real memtel node daemon on a free loopback port."""
    with run_node_daemon(tmp_path_factory.mktemp("daemon-state")) as url:
        yield url


def test_two_vllm_arms_run_to_a_complete_report_with_the_hook_and_the_daemon(tmp_path: Path, tiny_model: Path,
                                                                             node_daemon: str) -> None:
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
    run_dir = tmp_path / "run"
    result = run_ab(["run", str(ladder_path), "--out", str(run_dir)], timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert port_free(port_a) and port_free(port_b)
    check_complete_run(run_dir, ladder_path)


def check_complete_run(run_dir: Path, ladder_path: Path) -> None:
    recs = records(run_dir)
    assert not [r for r in recs if r["event"] == "block_superseded"]
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
    # One serve per arm, each stopped with its whole process group.
    starts = [r for r in recs if r["event"] == "serve_start"]
    assert [s["arm"] for s in starts] == ["stock", "fixed"]
    assert all(group_gone(s["pgid"]) for s in starts)
    assert [s["pgid"] for s in events(run_dir, "serve_stop")] == [s["pgid"] for s in starts]
    assert [r["status"] for r in recs if r["event"] == "run_end"] == ["complete"]
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
    assert "Prefix cache: 0 hit tokens in all 6 requests: every prefill was cold." in report
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(summary["requests"]) == 6 and summary["status"] == "complete"
    plots = summary["sections"]["plots"]
    for plot in plots:
        assert (run_dir / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"plots/mem_available_local.png", "plots/ttft.png", "plots/reserved_rank0.png"} <= set(plots)
