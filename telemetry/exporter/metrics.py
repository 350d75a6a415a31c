"""The exporter's own health as metrics: open connections and why connections were closed."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from telemetry.exporter.server import MetricsServer

# The close reasons that say something is wrong (a fixed set: the label stays bounded); ordinary ends of a
# connection (answered, closed by the client) are not exported. evicted: closed to make room under the bound.
CLOSE_REASONS = ("evicted", "idle_timeout", "request_timeout", "tls_failed")


class ExporterCollector:
    def __init__(self, server: MetricsServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        counts = self.server.counts()
        yield GaugeMetricFamily("memtel_exporter_http_connections_open",
                                "HTTP connections open on this exporter now.", value=self.server.open_connections)
        yield GaugeMetricFamily("memtel_exporter_http_connections_max",
                                "Most HTTP connections this exporter keeps open at once (the idlest is closed "
                                "past it).", value=self.server.max_connections)
        closed = CounterMetricFamily("memtel_exporter_http_connections_closed",
                                     "HTTP connections the exporter closed before an answer, by reason: evicted "
                                     "(to stay under the connection bound), idle_timeout, request_timeout, "
                                     "tls_failed.",
                                     labels=["reason"])
        for reason in CLOSE_REASONS:
            closed.add_metric([reason], counts.get(f"closed_{reason}", 0))
        yield closed
        yield CounterMetricFamily("memtel_exporter_http_unauthorized_requests",
                                  "HTTP requests refused for missing or wrong basic-auth credentials.",
                                  value=counts.get("unauthorized", 0))

    def describe(self) -> list[Metric]:
        return []


__all__ = ["CLOSE_REASONS", "ExporterCollector"]
