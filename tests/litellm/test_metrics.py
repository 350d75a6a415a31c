"""The gate's blindness and counts as the proxy shows them (telemetry/litellm/metrics.py through client.py's
middleware), without LiteLLM: `GET /memtel/metrics` answers the gate's registry, and `/health*` answers carry
`x-memtel-gate-blind` while a deployment the gate met is blind, against real loopback hook exporters."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from telemetry.admission.refusal import Refusal
from telemetry.litellm import client
from telemetry.litellm.gate import Gate
from telemetry.litellm.gauges import GateSettings, GaugeBook
from telemetry.litellm.metrics import GateMetrics
from tests.guard.servers import StubHook, exposition


def guarded(name: str, hook: str) -> dict[str, Any]:
    return {"model_name": name, "litellm_params": {"model": "openai/m", "api_base": "http://127.0.0.1:9/v1"},
            "model_info": {"id": name, "memtel_hooks": [hook]}}


async def get(watch: client.ClientWatch, path: str) -> tuple[int, dict[str, str], bytes]:
    """One GET through the middleware: status, headers, body."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await watch({"type": "http", "method": "GET", "path": path, "headers": []}, receive, send)
    headers = {k.decode(): v.decode() for k, v in sent[0].get("headers", [])}
    return sent[0]["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


async def health_app(scope: Any, receive: Any, send: Any) -> None:
    """LiteLLM's /health, as far as the middleware sees it."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"healthy_count": 1}'})


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def test_metrics_and_health_show_the_blind_deployment_its_failures_holds_and_refusals() -> None:
    seeing = StubHook(lambda: exposition(100_000))
    without = StubHook(lambda: "# a hook whose engine runs without the forecast\n")
    seeing.url, without.url = seeing.url + "/metrics", without.url + "/metrics"
    dead = "http://127.0.0.1:9/metrics"  # nothing listens: every scrape fails
    shown: dict[str, Any] = {}

    async def main() -> None:
        gate = Gate(GaugeBook(GateSettings(stale_s=3, timeout_s=1, hold_s=0)))
        view = GateMetrics(gate)
        watch = client.ClientWatch(health_app, view)
        try:
            shown["before"] = await get(watch, "/health/readiness")  # no deployment met yet: nothing to be blind about
            chat = {"model": "ok", "messages": [{"role": "user", "content": "w " * 10}]}
            await gate.decide("acompletion", chat, [guarded("ok", seeing.url)], True)  # admitted: one hold
            shown["seeing"] = await get(watch, "/health")
            with pytest.raises(Refusal):
                await gate.decide("acompletion", {**chat, "model": "nosuch"}, [], True)
            for name, hook in (("nogauge", without.url), ("dead", dead)):
                try:
                    await gate.decide("acompletion", {**chat, "model": name}, [guarded(name, hook)], True)
                except Refusal:
                    pass
            shown["blind"] = await get(watch, "/health")
            shown["other"] = await get(watch, "/v1/models")
            shown["metrics"] = await get(watch, client.METRICS_PATH)
        finally:
            await gate.aclose()

    try:
        asyncio.run(main())
    finally:
        seeing.stop()
        without.stop()
    assert client.BLIND_HEADER not in shown["before"][1] and client.BLIND_HEADER not in shown["seeing"][1]
    status, headers, _body = shown["blind"]
    why = headers[client.BLIND_HEADER]
    assert status == 200 and why.startswith("2 deployments blind; deployment dead: ") and "127.0.0.1:9" in why
    assert client.BLIND_HEADER not in shown["other"][1]  # only /health* says it
    status, headers, body = shown["metrics"]
    assert status == 200 and headers["content-type"].startswith("text/plain")
    found = samples(body)
    assert {d: found[("memtel_litellm_deployment_blind", (("deployment", d),))] for d in ("ok", "nogauge", "dead")} \
        == {"ok": 0.0, "nogauge": 1.0, "dead": 1.0}
    assert found[("memtel_litellm_hook_scrape_failures_total", (("hook", dead),))] >= 1
    assert found[("memtel_litellm_hook_scrape_failures_total", (("hook", seeing.url),))] == 0
    assert found[("memtel_litellm_refusals_total", (("reason", "unknown_model"),))] == 1
    assert found[("memtel_litellm_holds", ())] >= 1
