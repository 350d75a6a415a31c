"""The reported collapse, live: a real Prometheus with the shipped config and rules must raise
MemtelUnifiedHeadroomFalling within 5 s of a 29 GiB -> 2.5 GiB fall over 9 s that starts from a steady
state, while MemAvailable stays high throughout; MemtelUnifiedHeadroomLow follows once the floor is crossed
(MemtelContiguousMemoryExhausted needs failing huge-page faults, which this source does not serve), and the
MemAvailable alerts stay quiet.

The source (tests/dashboards/collapse.py) serves the daemon's metric names as the collapse replays; the
package's live stack (tests/dashboards/conftest.py) scrapes it as the memtel-daemon job of
configs/prometheus/prometheus.yml (its 1 s scrape), node spark-collapse, and evaluates every second. Once its
steady state is in Prometheus the stack starts the fall and a watch thread times the alerts (from the moment
the source starts falling to the moment /api/v1/alerts shows the alert firing, polled every 0.1 s) while the
other live tests run; this module, named to run after them, reads what the watch saw.
"""

from __future__ import annotations

import time

import pytest

from tests.dashboards.collapse import FALLING_WITHIN_S, FLOOR_ALERTS_WITHIN_S, NODE, STEADY_SAMPLES_NEEDED

pytestmark = [pytest.mark.prometheus, pytest.mark.slow, pytest.mark.timeout(240)]


def test_the_collapse_fires_headroom_falling_within_5_s(live_stack):
    api = live_stack.nodes.prometheus
    watch = live_stack.watch.result()
    print("firing after the collapse began: " + ", ".join(f"{k} {v:.1f} s" for k, v in watch.seen.items()))

    # A steady state first: the 8 s fit window full of 29 GiB samples before the fall, and nothing active on it
    # at any evaluation of the stack's rest (the stack's at-rest look covers every node, this one included).
    assert watch.steady_samples >= STEADY_SAMPLES_NEEDED, watch.steady_samples
    assert not [a for a in live_stack.nodes.rest_alerts if a["labels"].get("node") == NODE]

    assert "MemtelUnifiedHeadroomFalling" in watch.seen, f"MemtelUnifiedHeadroomFalling never fired {watch.errors}"
    assert watch.seen["MemtelUnifiedHeadroomFalling"] <= FALLING_WITHIN_S, watch.seen
    assert "MemtelUnifiedHeadroomLow" in watch.seen, watch.seen
    assert watch.seen["MemtelUnifiedHeadroomLow"] <= FLOOR_ALERTS_WITHIN_S, watch.seen
    falling = watch.first["MemtelUnifiedHeadroomFalling"]
    assert falling["labels"]["node"] == NODE and falling["labels"]["severity"] == "critical"
    # MemAvailable stayed at 60 GiB: the alerts that watch it alone saw nothing, at any evaluation since the fall.
    since = api.alerts_within(time.time() - watch.started_unix + 2)
    for name in ("MemtelMemAvailableLowBytes", "MemtelMemAvailableLowShare"):
        assert not [a for a in since if a["labels"]["alertname"] == name and a["labels"].get("node") == NODE], \
            f"{name} was active although MemAvailable stayed at 60 GiB"
