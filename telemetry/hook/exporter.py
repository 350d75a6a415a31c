"""The hook's HTTP exporter: the one place that turns the hook's registry into a listening /metrics.

It serves through memtel's shared exporter server (telemetry/exporter: idle timeout, bounded
connections, large backlog, optional TLS and basic auth from a web config file), so idle connections
or a connection flood cannot take threads or descriptors from the serving process. Imported only when
a process starts recording: a process that never records never listens.
"""

from __future__ import annotations

from typing import Protocol

from prometheus_client.registry import CollectorRegistry


class ExporterHandle(Protocol):
    port: int

    @property
    def url(self) -> str: ...   # "https://host:port" under a web config with TLS, else "http://host:port"

    def stop(self) -> None: ...

    def close_after_fork(self) -> None: ...


def start_exporter(registry: CollectorRegistry, host: str, port: int,
                   web_config: str | None = None) -> ExporterHandle:
    """Serve `registry` on host:port (web config file `web_config`: TLS and basic auth, or None for plain HTTP).

    Raises MemtelError (ConfigError for a bad address or web config, ListenError for a taken port) or
    OSError; the caller counts and logs it.
    """
    from telemetry.exporter import MetricsServer, load_web_config

    server = MetricsServer(host, port, registry, web_config=load_web_config(web_config), name="memtel-hook")
    server.start()
    return server


__all__ = ["ExporterHandle", "start_exporter"]
