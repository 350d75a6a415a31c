"""memtel's Ray Serve router beside Ray's default router, in one run on one local Ray cluster (BENCHMARKS.md).

    .venv/bin/python benchmarks/ray_router_bench.py [--pairs N] [--out FILE.json]

The fleet of tests/ray (tests/ray/stack.py: four lab engines of 1.5 GiB, a local Ray cluster from .venv-ray with
two Serve applications of two replicas each, `memtel` routed by MemtelRequestRouter and `default` by Ray's power of
two choices). Printed, and written as JSON with --out:

1. the start-up: lab engines and the Ray cluster with both applications answering;
2. routing latency: N pairs of a 100-word completion sent one at a time through the OpenAI client (kept-alive
   connection, no retries), the two applications alternating; p50 and p90 of each, and the p50 of the paired
   differences (memtel's minus default's): what the router adds to a request, end to end;
3. the router's own work per request, in-process (no Ray): `request_body`, `prompt_size` and `Fleet.route` (the
   core's decision) then `Fleet.release`, for a 100-word prompt with two replicas whose hooks are stub exporters on
   loopback; p50 and p90 in microseconds over --calls;
4. the burst: another tenant holds 0.9 GiB of one engine of each application (fresh engines); four prompts of
   300,000 words go to each application at once; completed, failed, and the engines' out-of-memory lines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.machine import machine  # noqa: E402
from harness.demo.guarded import prompt_text  # noqa: E402
from tests.ray.stack import APPS, RayStack, burst  # noqa: E402

LONG = 300_000
TENANT_GIB = 0.9
BURST = 4
WARM_UP = 20


def latencies(stack: RayStack, pairs: int) -> dict[str, Any]:
    import openai

    clients = {app: openai.OpenAI(base_url=stack.url(app), api_key="none", max_retries=0, timeout=30) for app in APPS}
    seconds: dict[str, list[float]] = {app: [] for app in APPS}
    try:
        for i in range(WARM_UP + pairs):
            prompt = prompt_text(100, i)
            for app in (APPS if i % 2 else APPS[::-1]):  # each goes first in half the pairs
                started = time.perf_counter()
                clients[app].completions.create(model="lab", prompt=prompt, max_tokens=1)
                if i >= WARM_UP:
                    seconds[app].append(time.perf_counter() - started)
    finally:
        for client in clients.values():
            client.close()
    ms = {app: [s * 1000 for s in values] for app, values in seconds.items()}
    found: dict[str, Any] = {app: {"p50_ms": statistics.median(v), "p90_ms": statistics.quantiles(v, n=10)[-1]}
                             for app, v in ms.items()}
    found["added_p50_ms"] = statistics.median(m - d for m, d in zip(ms["memtel"], ms["default"], strict=True))
    found["pairs"] = pairs
    return found


def decision_cost(calls: int) -> dict[str, Any]:
    import asyncio

    from telemetry.admission import Forward
    from telemetry.ray.fleet import Fleet, RouterSettings
    from telemetry.ray.replica import routing_stats
    from telemetry.ray.request import prompt_size, request_body
    from tests.guard.servers import StubHook, exposition

    hooks = [StubHook(lambda: exposition(300_000, node="a", at_best=350_000)),
             StubHook(lambda: exposition(200_000, node="b", at_best=350_000))]
    fleet = Fleet(RouterSettings())
    fleet.update([(f"r{i}", routing_stats([hook.url])) for i, hook in enumerate(hooks)])
    body = {"model": "lab", "prompt": prompt_text(100, 1), "max_tokens": 1}

    async def run() -> list[float]:
        took = []
        try:
            for i in range(WARM_UP * 5 + calls):
                started = time.perf_counter()
                found = request_body([body], {})
                assert found is not None
                forward = await fleet.route(prompt_size(found))
                assert isinstance(forward, Forward)
                fleet.release(forward)
                if i >= WARM_UP * 5:
                    took.append((time.perf_counter() - started) * 1e6)
        finally:
            await fleet.close()
        return took

    try:
        took = asyncio.run(run())
    finally:
        for hook in hooks:
            hook.stop()
    return {"p50_us": round(statistics.median(took), 1), "p90_us": round(statistics.quantiles(took, n=10)[-1], 1),
            "calls": calls}


def burst_side_by_side(stack: RayStack) -> dict[str, Any]:
    for app in APPS:
        stack.restart(app, 0)
        stack.restart(app, 1)
    for app in APPS:
        stack.tenant(app, 0, TENANT_GIB)
    time.sleep(3.0)  # the hooks' next forecast (1 s) and two of the router's reads (1 s each)
    found: dict[str, list[tuple[str, str, float]]] = {}
    threads = [threading.Thread(target=lambda app=app: found.__setitem__(app, burst(stack.url(app), LONG, BURST, 600)))
               for app in APPS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(200)
    return {app: {"completed": sum(1 for o in outcomes if o[0] == "ok"),
                  "failed": [o[1][:160] for o in outcomes if o[0] != "ok"],
                  "slowest_s": round(max(o[2] for o in outcomes), 2),
                  "oom_lines": sum(len(stack.oom_lines(app, i)) for i in (0, 1))}
            for app, outcomes in found.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=400)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    decision = decision_cost(args.calls)
    with tempfile.TemporaryDirectory(prefix="ray-bench-") as tmp:
        stack = RayStack(Path(tmp))
        try:
            stack.start()
            result: dict[str, Any] = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                      "start_s": round(stack.start_s or 0.0, 1)}
            result["decision"] = decision
            result["latency"] = latencies(stack, args.pairs)
            result["burst"] = burst_side_by_side(stack)
        finally:
            stopping = time.monotonic()
            stack.stop()
            print(f"stopped in {time.monotonic() - stopping:.1f} s")
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
