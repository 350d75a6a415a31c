"""The shipped Alertmanager configuration, live: routing, grouping by node and both inhibition rules.

A real Alertmanager (Debian's prometheus-alertmanager) runs configs/alertmanager/alertmanager.yml with
its webhook pointed at a receiver in this test. The alerts are posted to Alertmanager's own API as
Prometheus would post them, with the labels memtel's rules give (the rules themselves are exercised end
to end, NV_ERR alert to webhook, in test_live_prometheus.py).
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import httpx
import pytest

from tests.dashboards.live import WebhookReceiver, start_alertmanager, wait_until

pytestmark = [pytest.mark.prometheus, pytest.mark.slow, pytest.mark.timeout(120)]

GROUP_WAIT_S = 10  # the shipped route's group_wait


def alert(name: str, node: str, severity: str, family: str, **labels: str) -> dict:
    return {"labels": {"alertname": name, "node": node, "severity": severity, "family": family,
                       "monitor": "memtel", **labels},
            "annotations": {"summary": f"{name} on {node}",
                            "runbook_url": f"https://runbooks.example.test/memtel/runbook.md#{name.lower()}"}}


def firing_now(alerts: list[dict]) -> list[dict]:
    """The alerts as firing from now for 5 minutes. Stamped when posted, not at import: the suite collects
    this module many minutes before it runs, and alerts whose endsAt has passed are resolved on arrival."""
    now = datetime.now(timezone.utc)
    return [{**a, "startsAt": now.isoformat(), "endsAt": (now + timedelta(minutes=5)).isoformat()} for a in alerts]


POSTED = [
    # spark-b is down: its target-down alert adds nothing.
    alert("MemtelNodeDown", "spark-b", "critical", "node"),
    alert("MemtelTargetDown", "spark-b", "warning", "telemetry", job="memtel-hook", instance="192.168.100.12:9200"),
    # spark-a: the critical headroom alert silences the warning of its family, not of other families.
    alert("MemtelUnifiedHeadroomLow", "spark-a", "critical", "host-memory"),
    alert("MemtelContiguousMemoryExhausted", "spark-a", "warning", "host-memory"),
    alert("MemtelAllocatorRetries", "spark-a", "warning", "allocator", rank="0"),
    alert("MemtelTargetDown", "spark-a", "warning", "telemetry", job="memtel-vllm", instance="192.168.100.11:8000"),
    # A warning of the host-memory family on another node is not silenced by spark-a's critical alert.
    alert("MemtelContiguousMemoryExhausted", "spark-c", "warning", "host-memory"),
]
DELIVERED = {("MemtelNodeDown", "spark-b"), ("MemtelUnifiedHeadroomLow", "spark-a"),
             ("MemtelAllocatorRetries", "spark-a"), ("MemtelTargetDown", "spark-a"),
             ("MemtelContiguousMemoryExhausted", "spark-c")}
SUPPRESSED = {("MemtelTargetDown", "spark-b"), ("MemtelContiguousMemoryExhausted", "spark-a")}


@pytest.fixture
def alertmanager(tmp_path):
    webhook = WebhookReceiver()
    client = httpx.Client(timeout=10.0)
    process = None
    try:
        process, url = start_alertmanager(tmp_path, webhook.url, client)
        yield url, webhook, client
    except BaseException:
        if process is not None:
            print(process.log_tail())
        raise
    finally:
        if process is not None:
            process.stop()
        webhook.stop()
        client.close()


def test_node_down_and_critical_alerts_silence_what_they_explain(alertmanager):
    url, webhook, client = alertmanager
    response = client.post(f"{url}/api/v2/alerts", json=firing_now(POSTED))
    assert response.status_code == 200, response.text

    def states() -> dict[tuple[str, str], dict]:
        return {(a["labels"]["alertname"], a["labels"]["node"]): a["status"]
                for a in client.get(f"{url}/api/v2/alerts").json()}

    status = wait_until("Alertmanager has judged every alert",
                        lambda: (s := states()) and len(s) == len(POSTED) and
                        all(v["state"] != "unprocessed" for v in s.values()) and s, timeout=30)
    assert {k for k, v in status.items() if v["state"] == "suppressed"} == SUPPRESSED, status
    assert all(status[k]["inhibitedBy"] for k in SUPPRESSED), status

    wait_until("every delivered alert at the webhook",
               lambda: {(a["labels"]["alertname"], a["labels"]["node"]) for a in webhook.alerts()} >= DELIVERED,
               timeout=GROUP_WAIT_S + 20)
    time.sleep(2)
    delivered = {(a["labels"]["alertname"], a["labels"]["node"]) for a in webhook.alerts()}
    assert delivered == DELIVERED, f"delivered {delivered}"
    for body in webhook.notifications():
        # One notification per node and alert name; absolute runbook links survive the trip.
        assert set(body["groupLabels"]) == {"node", "alertname"}, body["groupLabels"]
        assert len({(a["labels"]["alertname"], a["labels"]["node"]) for a in body["alerts"]}) == 1
        assert all(a["annotations"]["runbook_url"].startswith("https://") for a in body["alerts"])
