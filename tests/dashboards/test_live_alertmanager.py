"""The shipped Alertmanager configuration, live: routing, grouping by node and both inhibition rules.

A real Alertmanager (Debian's prometheus-alertmanager) runs configs/alertmanager/alertmanager.yml with
its webhook pointed at a receiver in the test process and its default group_wait shortened to 1 s: the
package's live stack (tests/dashboards/conftest.py), shared with the Prometheus tests. The alerts are posted
to Alertmanager's own API as Prometheus would post them, with the labels memtel's rules give (the rules
themselves are exercised end to end, NV_ERR alert to webhook, in test_live_prometheus.py), on nodes of their
own (am-spark-*), so that nothing another test sends is silenced by them or counted here.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest

from tests.dashboards.live import GROUP_WAIT_S, wait_until

pytestmark = [pytest.mark.prometheus, pytest.mark.slow, pytest.mark.timeout(240)]  # the stack's start included

NODES = ("am-spark-a", "am-spark-b", "am-spark-c")


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
    # am-spark-b is down: its target-down alert adds nothing.
    alert("MemtelNodeDown", "am-spark-b", "critical", "node"),
    alert("MemtelTargetDown", "am-spark-b", "warning", "telemetry", job="memtel-hook",
          instance="192.168.100.12:9200"),
    # am-spark-a: the critical headroom alert silences the warning of its family, not of other families.
    alert("MemtelUnifiedHeadroomLow", "am-spark-a", "critical", "host-memory"),
    alert("MemtelContiguousMemoryExhausted", "am-spark-a", "warning", "host-memory"),
    alert("MemtelAllocatorRetries", "am-spark-a", "warning", "allocator", rank="0"),
    alert("MemtelTargetDown", "am-spark-a", "warning", "telemetry", job="memtel-vllm",
          instance="192.168.100.11:8000"),
    # A warning of the host-memory family on another node is not silenced by am-spark-a's critical alert.
    alert("MemtelContiguousMemoryExhausted", "am-spark-c", "warning", "host-memory"),
]
DELIVERED = {("MemtelNodeDown", "am-spark-b"), ("MemtelUnifiedHeadroomLow", "am-spark-a"),
             ("MemtelAllocatorRetries", "am-spark-a"), ("MemtelTargetDown", "am-spark-a"),
             ("MemtelContiguousMemoryExhausted", "am-spark-c")}
SUPPRESSED = {("MemtelTargetDown", "am-spark-b"), ("MemtelContiguousMemoryExhausted", "am-spark-a")}


def test_node_down_and_critical_alerts_silence_what_they_explain(live_stack):
    stack = live_stack.nodes
    url, webhook, client = stack.alertmanager_url, stack.webhook, stack.client
    assert webhook is not None
    response = client.post(f"{url}/api/v2/alerts", json=firing_now(POSTED))
    assert response.status_code == 200, response.text

    def states() -> dict[tuple[str, str], dict]:
        return {(a["labels"]["alertname"], a["labels"]["node"]): a["status"]
                for a in client.get(f"{url}/api/v2/alerts").json() if a["labels"].get("node") in NODES}

    def ours() -> list[dict]:
        return [a for a in webhook.alerts() if a["labels"].get("node") in NODES]

    def judged() -> dict[tuple[str, str], dict]:
        s = states()
        return s if len(s) == len(POSTED) and all(v["state"] != "unprocessed" for v in s.values()) else {}

    status = wait_until("Alertmanager has judged every alert", judged, timeout=30)
    # An alert reads "active" until the inhibitor has taken in the alerts that mute it (its own loop, a moment
    # after the API accepted them): look again until the suppressed set settles, at most 10 s, then compare.
    deadline = time.monotonic() + 10
    while {k for k, v in status.items() if v["state"] == "suppressed"} != SUPPRESSED and time.monotonic() < deadline:
        time.sleep(0.2)
        status = judged() or status
    assert {k for k, v in status.items() if v["state"] == "suppressed"} == SUPPRESSED, status
    assert all(status[k]["inhibitedBy"] for k in SUPPRESSED), status

    wait_until("every delivered alert at the webhook",
               lambda: {(a["labels"]["alertname"], a["labels"]["node"]) for a in ours()} >= DELIVERED,
               timeout=GROUP_WAIT_S + 20)
    time.sleep(GROUP_WAIT_S + 1)  # past group_wait: a suppressed alert would have been posted by now
    delivered = {(a["labels"]["alertname"], a["labels"]["node"]) for a in ours()}
    assert delivered == DELIVERED, f"delivered {delivered}"
    bodies = [b for b in webhook.notifications() if b.get("groupLabels", {}).get("node") in NODES]
    assert bodies
    for body in bodies:
        # One notification per node and alert name; absolute runbook links survive the trip.
        assert set(body["groupLabels"]) == {"node", "alertname"}, body["groupLabels"]
        assert len({(a["labels"]["alertname"], a["labels"]["node"]) for a in body["alerts"]}) == 1
        assert all(a["annotations"]["runbook_url"].startswith("https://") for a in body["alerts"])
