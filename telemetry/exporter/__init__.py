"""The HTTP side of memtel's exporters (the node daemon and the in-process hook): one hardened server.

- `MetricsServer` (server.py): /metrics (and /healthz) with an idle timeout, a bounded number of
  connections, a large backlog, a small worker pool, optional TLS and basic auth.
- `load_web_config` (webconfig.py): the Prometheus exporter toolkit's web config file
  (`tls_server_config`, `basic_auth_users`, `http_server_config.headers`); `WEB_CONFIG_ENV` names
  the environment variable the hook reads it from.
- HTTP through h11 (protocol.py: requests read, answers framed); the /metrics body (exposition.py: the bytes
  `generate_latest` writes, for less CPU; docs/architecture.md says why and by how much).
- `parse_listen` (address.py): HOST:PORT / [IPv6]:PORT checked before anything binds.
- `ExporterCollector` (metrics.py): the server's own connection metrics.
"""

from telemetry.exporter.address import format_listen, parse_listen
from telemetry.exporter.server import ListenError, MetricsServer, ServerLimits, listen_failed
from telemetry.exporter.webconfig import WEB_CONFIG_ENV, WebConfig, load_web_config

__all__ = ["WEB_CONFIG_ENV", "ListenError", "MetricsServer", "ServerLimits", "WebConfig", "format_listen",
           "listen_failed", "load_web_config", "parse_listen"]
