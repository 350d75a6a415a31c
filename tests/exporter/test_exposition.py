"""The /metrics renderer (telemetry/exporter/exposition.py) writes what prometheus_client's generate_latest
writes, byte for byte: on every family type and escape, on the families it hands to the library, and on the
daemon's real registry (the hook's is compared through its golden file, tests/hook/test_golden_metrics.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, Summary, generate_latest
from prometheus_client import metrics as client_metrics
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    StateSetMetricFamily,
    UnknownMetricFamily,
)

from telemetry.exporter.exposition import Renderer


class Fixed:
    """A registry whose families were collected once: both renderers see the same values."""

    def __init__(self, families) -> None:
        self.families = list(families)

    def collect(self):
        return iter(self.families)


def same(registry) -> str:
    fixed = Fixed(registry.collect())
    expected = generate_latest(fixed)
    assert Renderer().render(fixed) == expected
    return expected.decode()


@pytest.fixture
def created_series() -> Iterator[None]:
    """`_created` series on, whatever an earlier test in this process set (the lab's metrics turn them off for the
    whole process, as vLLM's /metrics has none), and put back after."""
    was = client_metrics._use_created
    client_metrics.enable_created_metrics()
    yield
    if not was:
        client_metrics.disable_created_metrics()


def test_every_family_type_and_escape_is_written_as_the_library_writes_it(created_series):
    registry = CollectorRegistry()
    counter = Counter("memtel_test_events", "Events with a\\backslash and a\nnewline.", ["site", "reason"],
                      registry=registry)
    counter.labels(site='a"quoted"', reason="line\nbreak").inc(3)
    counter.labels(site="back\\slash", reason="ok").inc(1e21)
    Gauge("memtel_test_bytes", "Bytes.", registry=registry).set(1.5e9)
    Gauge("memtel_test_nan", "NaN and infinities.", ["which"], registry=registry).labels(which="nan").set(float("nan"))
    histogram = Histogram("memtel_test_seconds", "A histogram.", ["rank"], buckets=(0.001, 0.1, 10),
                          registry=registry)
    histogram.labels(rank="0").observe(0.05)
    Summary("memtel_test_summary_seconds", "A summary.", registry=registry).observe(2.5)
    Info("memtel_test_build", "An info.", registry=registry).info({"version": "1.2.3", "path": "C:\\x"})
    text = same(registry)
    assert 'site="a\\"quoted\\""}' in text and "memtel_test_seconds_created" in text and "+Inf" in text


def test_families_of_the_other_types_and_the_ones_handed_to_the_library():
    class Custom:
        def collect(self):
            yield CounterMetricFamily("memtel_test_plain", "No suffix given.", value=2, created=1700000000.5)
            yield StateSetMetricFamily("memtel_test_state", "A state set.", value={"on": True, "off": False})
            yield GaugeHistogramMetricFamily("memtel_test_gh", "A gauge histogram.",
                                             buckets=[("1.0", 4), ("+Inf", 5)], gsum_value=7)
            yield UnknownMetricFamily("memtel_test_unknown", "Untyped.", value=1)
            dotted = GaugeMetricFamily("memtel.test.dotted", "A name outside the classic set.", labels=["l"])
            dotted.add_metric(["x"], 1)
            yield dotted
            stamped = GaugeMetricFamily("memtel_test_stamped", "A sample with a timestamp.", labels=["l"])
            stamped.add_metric(["x"], 1, timestamp=time.time())
            yield stamped
            odd_label = GaugeMetricFamily("memtel_test_odd_label", "A label name outside the set.", labels=["a.b"])
            odd_label.add_metric(["x"], 1)
            yield odd_label
            yield GaugeMetricFamily("memtel_test_empty", "No samples.")

    registry = CollectorRegistry()
    registry.register(Custom())
    text = same(registry)
    assert "# TYPE memtel_test_gh histogram" in text and "# TYPE memtel_test_unknown untyped" in text


def test_the_daemons_real_registry(tmp_path):
    import os

    from prometheus_client import ProcessCollector

    from telemetry.cli import build_parser
    from telemetry.daemon.cli import build_collectors
    from telemetry.daemon.config import from_args
    from telemetry.daemon.registry import DaemonCollectors

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    config = from_args(build_parser().parse_args(["daemon", "--state-dir", str(state),
                                                  "--disable-collector", "kmsg"]))
    collectors = build_collectors(config)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollectors(collectors, start_time=time.time()))
    ProcessCollector(registry=registry)
    text = same(registry)
    assert "memtel_node_mem_available_bytes" in text and f'pid="{os.getpid()}"' not in text


def test_one_renderer_over_many_scrapes_writes_each_scrapes_own_labels_and_values():
    """The renderer remembers label sets and values between scrapes; what it writes is still each scrape's own."""
    renderer = Renderer()
    scrapes = [
        [("a", 0.0), ("b", 1.0), ("c", float("nan"))],
        [("a", -0.0), ("b", 1), ("c", 2.5)],          # -0.0 after 0.0: equal keys, different texts
        [("b", 0.0), ("a", 1e21), ("c", float("nan"))],  # the same label values in another order, new values
        [("a\n", True), ('b"', 3.0), ("c\\", float("inf"))],
    ]
    for round_, samples in enumerate(scrapes):
        family = GaugeMetricFamily("memtel_test_remembered", "Remembered label sets.", labels=["site", "rank"])
        for i, (site, value) in enumerate(samples):
            family.add_metric([site, str(i)], value)
        counter = CounterMetricFamily("memtel_test_remembered_events", "Events.", labels=["site"])
        counter.add_metric([samples[0][0]], round_)
        fixed = Fixed([family, counter])
        assert renderer.render(fixed) == generate_latest(fixed), round_
