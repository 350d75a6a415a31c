"""One live Prometheus + Alertmanager stack for every live test of this package (started once, stopped after
the package's last test).

`live_stack` is tests/dashboards/live.py's `TwoNodeStack` (the DGX Spark pair on 127.0.0.2 and 127.0.0.3, a
real Alertmanager and its webhook) whose Prometheus also scrapes tests/dashboards/collapse.py's
`CollapseSource` as a third daemon, node spark-collapse. The tests keep apart by node: the two nodes' events
(test_live_prometheus.py), the collapse (test_live_prometheus_collapse.py) and the alerts posted straight to
Alertmanager under nodes of their own (test_live_alertmanager.py).

Before any test: every target up, SETTLE_S seconds of rule evaluations, then the look at rest (the targets,
every alert pending or firing at any evaluation of those seconds, the webhook's notifications), recorded on
the stack. Only then does the collapse source start falling, watched from a thread (`CollapseWatch`), while
the tests run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # the stack's modules import httpx: imported when the stack starts, so that collecting this
    # package (`pytest -m gpu` on a machine without the harness extra) needs nothing beyond the core
    from tests.dashboards.collapse import CollapseSource, CollapseWatch
    from tests.dashboards.live import TwoNodeStack

SETTLE_S = 8  # rule evaluations (1 s each) after every target is up, all of them looked at for the at-rest check


@dataclass
class LiveStack:
    nodes: TwoNodeStack
    collapse: CollapseSource
    watch: CollapseWatch | None = None
    closed: bool = False

    def close(self) -> None:
        """Stop everything (once)."""
        if self.closed:
            return
        self.closed = True
        if self.watch is not None:
            self.watch.stop()
        self.nodes.stop()
        self.collapse.stop()


_RUNNING: list[LiveStack] = []  # the package's stack while it runs


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the stack right after the last test that uses it, not after the package's last test: its processes
    would take CPU from the promtool tests that follow."""
    if not _RUNNING:
        return
    items = item.session.items
    later = items[items.index(nextitem):] if nextitem is not None and nextitem in items else []
    if not any("live_stack" in getattr(later_item, "fixturenames", ()) for later_item in later):
        _RUNNING.pop().close()


def _all_up(live: TwoNodeStack, expected: int) -> bool:
    live.check_running()
    targets = live.prometheus.targets()
    return len(targets) == expected and all(t["health"] == "up" for t in targets)


@pytest.fixture(scope="package")
def live_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    from tests.dashboards.collapse import STEADY_QUERY, STEADY_SAMPLES_NEEDED, CollapseSource, CollapseWatch
    from tests.dashboards.live import TwoNodeStack, wait_until

    source = CollapseSource()
    nodes = TwoNodeStack(tmp_path_factory.mktemp("live-stack"))
    live = LiveStack(nodes, source)
    _RUNNING.append(live)
    try:
        nodes.start(extra_targets={"daemon-collapse.yml": source.targets()})
        expected = 3 * len(nodes.nodes) + 1
        wait_until("every target up", lambda: _all_up(nodes, expected), timeout=90)
        settled_at = time.monotonic() + SETTLE_S
        wait_until(f"{SETTLE_S} s of evaluations and the collapse source's steady samples",
                   lambda: time.monotonic() >= settled_at and
                   nodes.prometheus.query(f"{STEADY_QUERY} >= {STEADY_SAMPLES_NEEDED}"),
                   timeout=SETTLE_S + 60, interval=0.25)
        nodes.rest_targets = nodes.prometheus.targets()
        nodes.rest_alerts = nodes.prometheus.alerts() + nodes.prometheus.alerts_within(SETTLE_S)
        assert nodes.webhook is not None
        nodes.rest_webhook = nodes.webhook.notifications()
        live.watch = CollapseWatch(source, nodes.prometheus.url)
        live.watch.start()
        yield live
    except BaseException:
        print(nodes.logs())
        raise
    finally:
        if live in _RUNNING:
            _RUNNING.remove(live)
        live.close()
