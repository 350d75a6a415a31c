"""The in-process allocator telemetry hook (docs/hook.md).

`install(targets, ...)` replaces each target ("package.module:function" or
"package.module:Class.method", or a preset name) by a wrapper that, after every call, records the
caching allocator's counters and the host's MemAvailable/SwapFree into Prometheus and a per-call
JSONL log. Importing this package never imports torch.
"""

from telemetry.hook.allocator import set_allocator_source
from telemetry.hook.presets import PRESETS
from telemetry.hook.session import HookConfig, HookHandle, active_handle, install, parse_targets
from telemetry.hook.targets import Target, parse_target

__all__ = [
           "PRESETS",
           "HookConfig",
           "HookHandle",
           "Target",
           "active_handle",
           "install",
           "parse_target",
           "parse_targets",
           "set_allocator_source",
]
