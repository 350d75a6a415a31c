"""The one reader of memtel's own metrics: where an endpoint is (ports.py: the one table of default ports; the one
URL parser is telemetry/url.py, a floor below, since config validation parses URLs too), how its /metrics is
fetched (fetch.py: one deadline, a bounded body) and read (reader.py: prometheus_client's parser, series looked
up by catalogue entry). The ledger, `top`, the flight recorder's hook scraper, the guard, the alert tests and the
lab read through it. docs/architecture.md, "Reading memtel's metrics".
"""

from __future__ import annotations

from telemetry.scrape.fetch import FetchError, get, read_metrics
from telemetry.scrape.ports import DAEMON_PORT, DEFAULT_PORTS, HOOK_PORT, LAB_PORT, hook_ports
from telemetry.scrape.reader import Exposition, ExpositionError, Sample, parse, parse_body, series_name

__all__ = ["DAEMON_PORT", "DEFAULT_PORTS", "HOOK_PORT", "LAB_PORT", "Exposition", "ExpositionError", "FetchError",
           "Sample", "get", "hook_ports", "parse", "parse_body", "read_metrics", "series_name"]
