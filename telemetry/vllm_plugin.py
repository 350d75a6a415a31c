"""vLLM general plugin: turns the hook on from the environment (entry point `vllm.general_plugins`).

vLLM calls general plugins in every process it starts (API server, engine core, workers) before
the model's modules are imported. `register()` reads the configuration, and installs the hook: a
target whose module is not imported yet is patched when that module is first imported, and the
exporter starts only in a process where a hooked function actually runs, so the API server never
listens. Neither torch nor vLLM is imported here.

Environment (docs/hook.md):
  MEMTEL_TARGETS      comma-separated targets ("pkg.module:function", "pkg.module:Class.method")
                      or preset names (vllm-sparse-indexer, ...)
  MEMTEL_ENABLE       1/0, true/false, yes/no, on/off; default on when MEMTEL_TARGETS is set
  MEMTEL_PORT         exporter base port, 1..65535, or "off"; default 9200; each process listens
                      on MEMTEL_PORT + its local rank
  MEMTEL_ADDR         exporter bind address, default 0.0.0.0
  MEMTEL_LOG_DIR      directory of the per-call JSONL logs; unset: no log
  MEMTEL_RECORD_SHAPE 1 to add [rows, cols] of the first tensor argument to each record

A bad value is one clear log line and telemetry off; the server itself is never affected.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger("memtel.vllm_plugin")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class PluginConfig:
    targets: tuple[str, ...]
    port: int | None
    addr: str
    log_dir: str | None
    record_shape: bool


def _flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    raw = environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean: expected 1/0, true/false, yes/no or on/off")


def config_from_env(environ: Mapping[str, str]) -> PluginConfig | None:
    """The plugin's configuration, None when telemetry is off; ValueError names the bad variable."""
    from telemetry.hook.session import DEFAULT_PORT, parse_targets

    targets_raw = environ.get("MEMTEL_TARGETS", "")
    if not _flag(environ, "MEMTEL_ENABLE", default=bool(targets_raw.strip())):
        return None
    if not targets_raw.strip():
        raise ValueError("MEMTEL_ENABLE is on but MEMTEL_TARGETS is empty: expected comma-separated "
                         '"package.module:function" targets or preset names')
    try:
        targets = tuple(t.name for t in parse_targets(targets_raw))
    except ValueError as error:
        raise ValueError(f"MEMTEL_TARGETS: {error}") from None
    port_raw = environ.get("MEMTEL_PORT", "").strip()
    port: int | None = DEFAULT_PORT
    if port_raw.lower() == "off":
        port = None
    elif port_raw:
        try:
            port = int(port_raw)
        except ValueError:
            port = -1
        if not 0 < port < 65536:
            raise ValueError(f"MEMTEL_PORT={port_raw!r} is not a port: expected an integer in 1..65535 "
                             '(each process listens on MEMTEL_PORT + its local rank) or "off"')
    log_dir = environ.get("MEMTEL_LOG_DIR") or None
    if log_dir is not None:
        if os.path.exists(log_dir) and not os.path.isdir(log_dir):
            raise ValueError(f"MEMTEL_LOG_DIR={log_dir!r} exists and is not a directory")
        try:
            os.makedirs(log_dir, exist_ok=True)
        except OSError as error:
            raise ValueError(f"MEMTEL_LOG_DIR={log_dir!r} cannot be created: {error.strerror}") from None
        if not os.access(log_dir, os.W_OK | os.X_OK):
            raise ValueError(f"MEMTEL_LOG_DIR={log_dir!r} is not writable")
    addr = environ.get("MEMTEL_ADDR", "").strip() or "0.0.0.0"
    return PluginConfig(targets, port, addr, log_dir, _flag(environ, "MEMTEL_RECORD_SHAPE", default=False))


def register(environ: Mapping[str, str] | None = None) -> None:
    """vLLM's entry point. Never raises: the server must start whatever memtel's configuration is."""
    try:
        config = config_from_env(os.environ if environ is None else environ)
    except ValueError as error:
        log.error("memtel telemetry off: %s", error)
        return
    except Exception as error:  # never let telemetry stop the server
        log.error("memtel telemetry off: reading the MEMTEL_* configuration failed: %r", error)
        return
    if config is None:
        return
    try:
        from telemetry.hook import install

        install(config.targets, port=config.port, addr=config.addr, log_dir=config.log_dir,
                record_shape=config.record_shape)
    except Exception as error:
        log.error("memtel telemetry off: installing the hook failed: %r", error)
