"""The hook's environment variables, named once: what a serving process is told through MEMTEL_*.

The hook (telemetry/hook/config.py reads them into HookConfig), `memtel run` and its bootstrap, the fit budget,
the lab, the A/B harness and the benchmarks all set or read them by these names; tests/test_hook_env.py holds that
no other module types one. The names only: what each means, its default and its check are HookConfig's field
(docs/hook.md lists them). The hook's default ports are in telemetry/scrape/ports.py, the one table of default
ports. A module of names and nothing else, on the lowest floor, since `memtel run`'s bootstrap imports it at the
start of every Python process it serves.
"""

from __future__ import annotations

ENABLE = "MEMTEL_ENABLE"  # 1/0: on by default once TARGETS is set
TARGETS = "MEMTEL_TARGETS"  # the functions to hook ("package.module:function", presets)
PORT = "MEMTEL_PORT"  # the exporter's base port (+ local rank), or "off"
ADDR = "MEMTEL_ADDR"  # the exporter's bind address
WEB_CONFIG = "MEMTEL_WEB_CONFIG"  # the exporter toolkit's web config (TLS, basic auth)
LOG_DIR = "MEMTEL_LOG_DIR"  # the per-call JSONL logs' directory
RECORD_SHAPE = "MEMTEL_RECORD_SHAPE"  # the first tensor's [rows, cols] in each record

FORECAST_PREFIX = "MEMTEL_FORECAST_"  # every live-forecast setting starts so
FORECAST_TOKENS = FORECAST_PREFIX + "TOKENS"  # the prefill lengths to forecast, or "off"
FORECAST_INTERVAL_S = FORECAST_PREFIX + "INTERVAL_S"  # seconds between forecasts
FORECAST_SHAPE = FORECAST_PREFIX + "SHAPE"  # the indexer workload where the engine does not give it
FORECAST_SNAPSHOT = FORECAST_PREFIX + "SNAPSHOT"  # "native" or "python": which reader snapshots the allocator
FORECAST_SHADOW = FORECAST_PREFIX + "SHADOW"  # on/off: the event shadow kept between full snapshots
HOOK_HISTORY = "MEMTEL_HOOK_HISTORY"  # torch's allocation recorder on, for `memtel tune --hook`
GUARD_RESERVE_MB = "MEMTEL_GUARD_RESERVE_MB"  # MiB the fit budget keeps free on the node

RUN_DIR = "MEMTEL_RUN_DIR"  # `memtel run`: its private directory (boot order, ranks)
RUN_UNRESOLVED_AFTER_S = "MEMTEL_RUN_UNRESOLVED_AFTER_S"  # `memtel run`: when "nothing hooked" is said

HOOK_VARIABLES = (ENABLE, TARGETS, PORT, ADDR, WEB_CONFIG, LOG_DIR, RECORD_SHAPE, FORECAST_TOKENS,
                  FORECAST_INTERVAL_S, FORECAST_SHAPE, FORECAST_SNAPSHOT, FORECAST_SHADOW, HOOK_HISTORY,
                  GUARD_RESERVE_MB, RUN_DIR, RUN_UNRESOLVED_AFTER_S)

__all__ = ["ADDR", "ENABLE", "FORECAST_INTERVAL_S", "FORECAST_PREFIX", "FORECAST_SHADOW", "FORECAST_SHAPE",
           "FORECAST_SNAPSHOT", "FORECAST_TOKENS", "GUARD_RESERVE_MB", "HOOK_HISTORY", "HOOK_VARIABLES", "LOG_DIR",
           "PORT", "RECORD_SHAPE", "RUN_DIR", "RUN_UNRESOLVED_AFTER_S", "TARGETS", "WEB_CONFIG"]
