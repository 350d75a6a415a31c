"""vLLM general plugin: turns the hook on from the environment (entry point `vllm.general_plugins`).

vLLM calls general plugins in every process it starts (API server, engine core, workers) before
the model's modules are imported. `register()` reads the configuration (`HookConfig.from_env`) and
installs the hook: a target whose module is not imported yet is patched when that module is first
imported, and the exporter starts only in a process where a hooked function runs or the model is
loaded, so the API server never listens. After a worker has loaded the model (vLLM's
`Worker.load_model` returned), targets that have not resolved are reported once. Neither torch nor
vLLM is imported here.

Environment (docs/hook.md):
  MEMTEL_TARGETS      comma-separated targets ("pkg.module:function", "pkg.module:Class.method")
                      or preset names (vllm-sparse-indexer, ...)
  MEMTEL_ENABLE       1/0, true/false, yes/no, on/off; default on when MEMTEL_TARGETS is set
  MEMTEL_PORT         exporter base port, 1..65535, or "off"; default 9200; each process listens
                      on MEMTEL_PORT + its local rank
  MEMTEL_ADDR         exporter bind address, default 0.0.0.0
  MEMTEL_WEB_CONFIG   the exporter's web config file (TLS, basic auth); unset: plain HTTP
  MEMTEL_LOG_DIR      directory of the per-call JSONL logs; unset: no log
  MEMTEL_RECORD_SHAPE 1 to add [rows, cols] of the first tensor argument to each record
  MEMTEL_FORECAST_TOKENS, MEMTEL_FORECAST_INTERVAL_S, MEMTEL_FORECAST_SHAPE
                      the live forecast (docs/hook.md, "Live forecast"); its workload is read from
                      vLLM's config when Worker.load_model returns

A bad value is one clear log line and telemetry off (a bad MEMTEL_FORECAST_* value: the forecast off);
the server itself is never affected. The
hook's log lines (logger `memtel`) go to vLLM's log handler, so they appear in vLLM's output. Under
`memtel run` the plugin does nothing: the run's bootstrap installed the hook in this process already.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not imported at run time: the plugin is imported by every vLLM process
    from telemetry.hook.config import HookConfig

log = logging.getLogger("memtel.vllm_plugin")


def config_from_env(environ: Mapping[str, str]) -> HookConfig | None:
    """The hook's configuration for vLLM, None when telemetry is off; ConfigError names the bad variable."""
    from telemetry.hook.config import HookConfig
    from telemetry.hook.engine import START_BEGIN_SIGNALS
    from telemetry.hook.presets import ENGINE_MEMORY, MODEL_LOADED

    # The model-loaded signal, not a timer: a timer would also fire in the API server, which never
    # imports the model's modules. The start's beginning (the worker's memory budget known) is an engine
    # signal too: the exporter says from then on what the start will still take (docs/alerts.md, "Falling").
    return HookConfig.from_env(environ, model_loaded=MODEL_LOADED["vllm"],
                               engine_memory=ENGINE_MEMORY["vllm"] + START_BEGIN_SIGNALS["vllm"],
                               unresolved_after_s=None)


def show_in_vllm_log() -> None:
    """Send the `memtel` loggers' lines to vLLM's handler (vLLM's format, stream and level).

    vLLM configures only its own `vllm` logger (propagate off) and leaves the root logger bare, where
    INFO lines go nowhere. Nothing changes where `memtel` has handlers already, where the root logger
    has some (the application configured logging) or where vLLM's logging is off (VLLM_CONFIGURE_LOGGING=0).
    """
    memtel = logging.getLogger("memtel")
    vllm = logging.getLogger("vllm")
    if memtel.handlers or logging.getLogger().handlers or not vllm.handlers:
        return
    for handler in vllm.handlers:
        memtel.addHandler(handler)
    memtel.setLevel(vllm.level or logging.INFO)
    memtel.propagate = False


def installed_by_memtel_run() -> bool:
    """`memtel run`'s bootstrap ran in this process: it installed the hook (or said why not) already."""
    boot = sys.modules.get("telemetry.run.boot")
    return bool(getattr(boot, "RAN", False))


def register(environ: Mapping[str, str] | None = None) -> None:
    """vLLM's entry point. Never raises: the server must start whatever memtel's configuration is."""
    if installed_by_memtel_run():
        return   # one hook per process: memtel run's (its configuration includes vLLM's model-loaded signal)
    try:
        show_in_vllm_log()
    except Exception:
        pass
    try:
        config = config_from_env(os.environ if environ is None else environ)
    except ValueError as error:  # ConfigError: one line that says what is wrong
        log.error("memtel telemetry off: %s", error)
        return
    except Exception as error:  # never let telemetry stop the server
        log.error("memtel telemetry off: reading the MEMTEL_* configuration failed: %r", error)
        return
    if config is None:
        return
    try:
        from telemetry.hook import install_config

        install_config(config)
    except Exception as error:
        log.error("memtel telemetry off: installing the hook failed: %r", error)
