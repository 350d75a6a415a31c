"""The Ray Serve side of the live tests, run in .venv-ray: a local Ray cluster and two Serve applications.

    python tests/ray/app.py --port P --slots DIR --memtel URL=HOOK,URL=HOOK --default URL=HOOK,URL=HOOK

Each application is an ingress (`/memtel/v1/...`, `/default/v1/...`) in front of a deployment of two replicas,
`Engine`, each of which proxies to one lab engine (`memtel lab serve`, started by the test) and says in its
routing stats where that engine's hook and /tokenize are (telemetry/ray/replica.py). The `memtel` application's
`Engine` routes with telemetry.ray.router's `MemtelRequestRouter`; the `default` one with Ray's own (power of two
choices). A replica takes the first of its application's engines that no live replica holds (an flock on a file
in DIR: the lock dies with the replica's process, so a replica Serve starts again takes the same engine).

It writes DIR/ready once both applications answer, and stops Serve and Ray on SIGTERM.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response

from telemetry.ray.refusal import refusal_answer
from telemetry.ray.replica import routing_stats
from telemetry.ray.router import router_config

STATS_PERIOD_S = 0.5  # how often Serve's controller asks each replica for its routing stats (default 10)
QUEUE_S = 60.0  # how long a prompt that fits no replica now waits
UPSTREAM_TIMEOUT_S = 300.0


def _json(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body), status, headers=headers, media_type="application/json")


@serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64,
                  health_check_period_s=1)
class Engine:
    """One replica: a proxy to one lab engine; its routing stats name the engine's hook and base URL."""

    def __init__(self, slots: str, app: str, engines: list[tuple[str, str]]) -> None:
        self._lock = None
        for index, (url, hook) in enumerate(engines):
            lock = open(Path(slots) / f"{app}-{index}.lock", "a+")  # noqa: SIM115  # held for the replica's life
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                lock.close()
                continue
            lock.seek(0)
            lock.truncate()
            lock.write(json.dumps({"pid": os.getpid(), "url": url, "hook": hook}))
            lock.flush()
            self._lock, self.url, self.hook = lock, url, hook
            break
        if self._lock is None:
            raise RuntimeError(f"every engine of {app} is held by a live replica")
        self.client = httpx.AsyncClient(timeout=UPSTREAM_TIMEOUT_S, trust_env=False)

    async def completions(self, body: dict[str, Any]) -> tuple[int, bytes, str]:
        try:
            answer = await self.client.post(f"{self.url}/v1/completions", json=body)
        except httpx.HTTPError as exc:
            return 502, json.dumps({"error": {"message": f"the engine did not answer: {exc!r}",
                                              "type": "upstream_unavailable", "code": 502}}).encode(), self.url
        return answer.status_code, answer.content, self.url

    async def models(self) -> tuple[int, bytes]:
        answer = await self.client.get(f"{self.url}/v1/models")
        return answer.status_code, answer.content

    def record_routing_stats(self) -> dict[str, Any]:
        return routing_stats([self.hook], upstream=self.url)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
class Ingress:
    """The OpenAI surface the client sees: /v1/completions and /v1/models, answered by an `Engine` replica."""

    def __init__(self, engines: DeploymentHandle) -> None:
        self.engines = engines

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if request.method == "GET" and path.endswith("/v1/models"):
            status, data = await self.engines.models.remote()
            return Response(data, status, media_type="application/json")
        if request.method != "POST" or not path.endswith("/v1/completions"):
            return _json(404, {"error": {"message": f"no route {request.method} {path}", "code": 404}})
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _json(400, {"error": {"message": "the body is not JSON", "type": "invalid_request_error",
                                         "code": 400}})
        try:
            status, data, served_by = await self.engines.completions.remote(body)
        except Exception as exc:  # the router's refusal arrives as the call's exception
            answer = refusal_answer(exc)
            if answer is None:
                raise
            return _json(*answer)
        return Response(data, status, headers={"x-served-by": served_by}, media_type="application/json")


def engines_of(text: str) -> list[tuple[str, str]]:
    pairs = []
    for item in text.split(","):
        url, _, hook = item.partition("=")
        pairs.append((url, hook))
    return pairs


def application(name: str, slots: str, engines: list[tuple[str, str]], memtel: bool) -> Any:
    if memtel:  # the router as docs/ray.md configures it (stale_s 15: a dead engine leaves by its /health, not by age)
        config = router_config(STATS_PERIOD_S, queue_s=QUEUE_S)
    else:
        config = RequestRouterConfig(request_routing_stats_period_s=STATS_PERIOD_S,
                                     request_routing_stats_timeout_s=STATS_PERIOD_S * 2)
    return Ingress.bind(Engine.options(request_router_config=config).bind(slots, name, engines))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--slots", required=True)
    parser.add_argument("--memtel", required=True)
    parser.add_argument("--default", required=True)
    args = parser.parse_args()
    import ray

    # address="local": a new cluster of its own, never one another process left running here.
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(application("memtel", args.slots, engines_of(args.memtel), True), name="memtel",
                  route_prefix="/memtel", blocking=False)
        serve.run(application("default", args.slots, engines_of(args.default), False), name="default",
                  route_prefix="/default", blocking=False)
        Path(args.slots, "ready").write_text("ready\n")
        print("ray-app ready", flush=True)
        stop.wait()
    finally:
        ray.shutdown()  # Serve's actors go with the cluster
    return 0


if __name__ == "__main__":
    sys.exit(main())
