"""Records a real vLLM CPU start with memtel's plugin through the daemon's flight recorder: a corpus timeline.

    .venv/bin/python -m tests.alerts.record_vllm_start [--out tests/fixtures/alerts/corpus/vllm-cpu-start-live.jsonl.gz]

It starts `memtel daemon` (a private state directory, the flight recorder at one record a second, the plugin's
hook exporter as its `flight.hook_targets`), then vLLM CPU (.venv-vllm, the tests' tiny Llama, --enforce-eager,
`--gpu-memory-utilization` of the node, no explicit KV cache size) with the plugin on, waits until vLLM is
healthy and `--serve` seconds more, stops vLLM and then the daemon, and writes the flight ring as a benign
timeline (docs/alerts.md, "The corpus"): the headroom, and what the plugin said the start would still take
from init_device to warm-up, as the daemon recorded them. It takes a minute or two of two cores; it is not
part of the test suite.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.alerts.make_corpus import CORPUS
from tests.support.ports import free_port
from tests.support.vllm import VllmServer, cached_tiny_llama

TARGET = "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward"
SERIES = "memtel_engine_start_remaining_bytes"


def record(out: Path, serve_s: float, utilization: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="memtel-vllm-start-") as scratch:
        state, hook_port = Path(scratch) / "state", free_port()
        config = Path(scratch) / "daemon.yaml"
        config.write_text(json.dumps({"flight": {"interval_seconds": 1, "hook_targets": [f"127.0.0.1:{hook_port}"]}}))
        daemon = subprocess.Popen([sys.executable, "-m", "telemetry", "daemon", "--state-dir", str(state),
                                   "--config", str(config), "--listen", "127.0.0.1:0", "--flight-duration", "3600s",
                                   "--log-level", "warning"], stdin=subprocess.DEVNULL)
        server = VllmServer(cached_tiny_llama(), free_port(), log_path=Path(scratch) / "vllm.log",  # copied out
                            env={"MEMTEL_TARGETS": TARGET, "MEMTEL_PORT": str(hook_port), "MEMTEL_ADDR": "127.0.0.1"},
                            extra_args=("--enforce-eager", "--max-num-seqs", "4",
                                        "--gpu-memory-utilization", f"{utilization:g}"))
        # No explicit KV cache size: the CPU worker budgets `utilization` of its NUMA node's memory
        # (requested_cpu_memory, known at init_device) and gives the KV cache what the model leaves of it.
        server.env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        try:
            time.sleep(10)  # the daemon's first records: the node before the start
            started = time.time()
            server.start()
            server.wait_healthy(timeout=600)
            healthy = time.time()
            time.sleep(serve_s)
            server.stop()
            time.sleep(10)
        finally:
            server.stop()
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=60)
            shutil.copy(server.log_path, out.with_name(out.name.split(".")[0] + ".vllm.log"))
        export = subprocess.run([sys.executable, "-m", "telemetry", "flight", "show", "--state-dir", str(state),
                                 "--json"], capture_output=True, text=True, check=True).stdout
    records = [json.loads(line) for line in export.splitlines()]
    starting = [r["time"] for r in records if any(k.startswith(SERIES) for k in r["values"])]
    header = {"memtel_timeline": {
        "outcome": "benign", "node": "vllm-cpu-live",
        "description": f"A real vLLM CPU start (vllm-cpu 0.32, the tests' tiny Llama, gpu_memory_utilization "
                       f"{utilization:g} of the NUMA node's memory, the KV cache taking what the model leaves) with "
                       f"memtel's plugin, recorded by the daemon's flight recorder on this machine; healthy "
                       f"{healthy - started:.0f} s after launch, served {serve_s:g} s, stopped."}}
    text = "".join(json.dumps(line, sort_keys=True) + "\n" for line in [header, *records])
    out.write_bytes(gzip.compress(text.encode(), mtime=0))
    return {"records": len(records), "healthy_after_s": healthy - started,
            "start_series_records": len(starting),
            "start_series_s": (max(starting) - min(starting)) if starting else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description="record a real vLLM CPU start through the flight recorder")
    parser.add_argument("--out", type=Path, default=CORPUS / "vllm-cpu-start-live.jsonl.gz")
    parser.add_argument("--serve", type=float, default=20.0, help="seconds to keep serving once healthy")
    parser.add_argument("--utilization", type=float, default=0.3, help="--gpu-memory-utilization (the CPU "
                        "worker's share of its NUMA node's memory)")
    args = parser.parse_args()
    print(json.dumps(record(args.out, args.serve, args.utilization)))


if __name__ == "__main__":
    main()
