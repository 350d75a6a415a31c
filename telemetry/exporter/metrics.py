"""The exporter's own health as metrics: open connections and why connections were closed."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from telemetry.catalogue import described
from telemetry.catalogue import metrics as catalogue
from telemetry.exporter.server import MetricsServer

# The close reasons that say something is wrong (a fixed set: the label stays bounded); ordinary ends of a
# connection (answered, closed by the client) are not exported. evicted: closed to make room under the bound.
CLOSE_REASONS = ("evicted", "idle_timeout", "request_timeout", "tls_failed")


class ExporterCollector:
    def __init__(self, server: MetricsServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        counts = self.server.counts()
        yield catalogue.HTTP_CONNECTIONS_OPEN.new(self.server.open_connections)
        yield catalogue.HTTP_CONNECTIONS_MAX.new(self.server.max_connections)
        closed = catalogue.HTTP_CONNECTIONS_CLOSED.new()
        for reason in CLOSE_REASONS:
            closed.add_metric([reason], counts.get(f"closed_{reason}", 0))
        yield closed
        yield catalogue.HTTP_UNAUTHORIZED.new(counts.get("unauthorized", 0))

    def describe(self) -> list[Metric]:
        """The catalogue's exporter families: a second collector of them in one registry is refused."""
        return described("exporter")


__all__ = ["CLOSE_REASONS", "ExporterCollector"]
