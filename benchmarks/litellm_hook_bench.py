"""The added latency of memtel's LiteLLM pre-call hook and routing filter, in-process (BENCHMARKS.md).

    .venv-litellm/bin/python benchmarks/litellm_hook_bench.py [--calls N]

A litellm.Router with two deployments, each naming one hook (a local HTTP server answering a hook's forecast
lines); a 1,000-word chat prompt admitted by its byte bound (no /tokenize), as most prompts are. Each call runs
`MemtelPreCall.async_pre_call_hook` then `MemtelRouting.async_filter_deployments` (what the proxy adds to a
request) and releases the hold; printed: p50, p90, p99 in microseconds, and the loop's CPU share.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from litellm import Router

from telemetry.catalogue.metrics import FORECAST_FIT_BUDGET, FORECAST_LAST_SUCCESS, FORECAST_MAX_PREFILL_TOKENS
from telemetry.litellm.gate import HOLD_KEY, Gate
from telemetry.litellm.gauges import GateSettings, GaugeBook
from telemetry.litellm.pre_call import MemtelPreCall
from telemetry.litellm.routing import MemtelRouting


def hook_server(tokens: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            labels = 'rank="0",node="bench"'
            body = (f"{FORECAST_MAX_PREFILL_TOKENS.series}{{{labels}}} {tokens}\n"
                    f"{FORECAST_FIT_BUDGET.series}{{{labels}}} {8 << 30}\n"
                    f"{FORECAST_LAST_SUCCESS.series}{{{labels}}} {time.time()}\n").encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


async def run(calls: int) -> list[float]:
    servers = [hook_server(270_000), hook_server(532_000)]
    model_list = [{"model_name": "m", "litellm_params": {"model": "openai/m", "api_base": "http://127.0.0.1:9/v1"},
                   "model_info": {"id": f"d{i}", "memtel_hooks": [f"http://127.0.0.1:{s.server_address[1]}"]}}
                  for i, s in enumerate(servers)]
    router = Router(model_list=model_list)
    gate = Gate(GaugeBook(GateSettings()))
    pre, routing = MemtelPreCall(gate, router=router), MemtelRouting(gate)
    messages = [{"role": "user", "content": " ".join(f"w{i}" for i in range(1000))}]
    deployments = router.get_model_list(model_name="m") or []
    seconds = []
    for i in range(calls + 100):
        data: dict[str, Any] = {"model": "m", "messages": messages, "litellm_call_id": f"c{i}"}
        started = time.perf_counter()
        data = await pre.async_pre_call_hook(None, None, data, "acompletion")
        await routing.async_filter_deployments("m", list(deployments), messages, {"metadata": data["metadata"]})
        elapsed = time.perf_counter() - started
        gate.release(data["metadata"][HOLD_KEY])
        if i >= 100:  # the first calls start the scrapes
            seconds.append(elapsed)
    await gate.aclose()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    cpu = time.process_time()
    wall = time.perf_counter()
    seconds = sorted(asyncio.run(run(args.calls)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    q = statistics.quantiles(seconds, n=100)
    print(f"{len(seconds)} calls: p50 {q[49] * 1e6:.0f} µs, p90 {q[89] * 1e6:.0f} µs, p99 {q[98] * 1e6:.0f} µs "
          f"(process CPU {cpu:.1f} s over {wall:.1f} s wall)")


if __name__ == "__main__":
    main()
