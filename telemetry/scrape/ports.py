"""The default ports of memtel's endpoints, one table; the servers take their defaults from it and the readers
(`memtel ledger`, `top`, the alert tests' instances) look endpoints up in it.

- daemon: the node daemon's /metrics, next to node_exporter's 9100 and far from dcgm-exporter's 9400.
- hook: the hook's exporter in each serving process; local rank r listens on 9200 + r (MEMTEL_PORT moves it).
- lab: the lab server, on vLLM's default port, since the harness talks to it as to vLLM.

The guard has no default port (`memtel guard --listen` and `--metrics-listen` are always given), nor has the
exporter package (telemetry/exporter): it serves on whatever port its owner (the daemon, a hook) passes.
"""

from __future__ import annotations

from types import MappingProxyType

DAEMON_PORT = 9101
HOOK_PORT = 9200
LAB_PORT = 8000
HOOK_LOCAL_RANKS = 8  # the readers try the hook ports of local ranks 0..7 on a node
HOOK_PORT_RANGE = f"{HOOK_PORT}-{HOOK_PORT + HOOK_LOCAL_RANKS - 1}"  # as messages and help texts say it

DEFAULT_PORTS = MappingProxyType({"daemon": DAEMON_PORT, "hook": HOOK_PORT, "lab": LAB_PORT})


def hook_ports() -> range:
    """The hook exporters' default ports on one node, local rank 0 first."""
    return range(HOOK_PORT, HOOK_PORT + HOOK_LOCAL_RANKS)


__all__ = ["DAEMON_PORT", "DEFAULT_PORTS", "HOOK_LOCAL_RANKS", "HOOK_PORT", "HOOK_PORT_RANGE", "LAB_PORT", "hook_ports"]
