"""The in-process allocator telemetry hook (docs/hook.md).

`install(targets, **options)` replaces each target ("package.module:function" or
"package.module:Class.method", or a preset name) by a wrapper that, after every call, records the
caching allocator's counters and the host's MemAvailable/SwapFree into Prometheus and a per-call
JSONL log. Every setting is a field of `HookConfig` (also read from MEMTEL_* by `HookConfig.from_env`).
Importing this package never imports torch.

Modules: config (the one configuration), session (install, the process's start, the unresolved
check), record (the hot path), state (the numbers), collector and exporter (Prometheus), line_format
and log_writer (the call log), allocator (the allocator readers), passthrough (compile/capture
pass-through), rank, targets (parse, patch, import watcher) and presets; forecast/ (the live forecast:
a thread that simulates the next prefill from the allocator's snapshot, docs/hook.md "Live forecast").
"""

from telemetry.hook.allocator import set_allocator_source
from telemetry.hook.config import DEFAULT_PORT, HookConfig
from telemetry.hook.forecast import set_forecast_workload
from telemetry.hook.presets import PRESETS
from telemetry.hook.session import HookHandle, active_handle, install, install_config
from telemetry.hook.targets import Target, parse_target, parse_targets

__all__ = [
    "DEFAULT_PORT",
    "PRESETS",
    "HookConfig",
    "HookHandle",
    "Target",
    "active_handle",
    "install",
    "install_config",
    "parse_target",
    "parse_targets",
    "set_allocator_source",
    "set_forecast_workload",
]
