"""The hook's one configuration: every setting with its default, its check and its MEMTEL_* variable.

`install(targets, **options)`, the vLLM plugin (`HookConfig.from_env`) and any later entry point build
this one frozen object, and the session builds everything else from it. A new setting is one field:
its default, its check in `__post_init__` and, if it can be set from the environment, `env(NAME, parser)`
in the field's metadata (the parser turns the variable's text into the value or raises ConfigError
saying what is expected). An unset or blank variable leaves the default.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from telemetry import hook_env
from telemetry.errors import ConfigError
from telemetry.hook.forecast.settings import DEFAULT_INTERVAL_S, check_interval, check_tokens
from telemetry.hook.targets import parse_target, parse_targets
from telemetry.procfs.meminfo import MEMINFO_PATH
from telemetry.scrape.ports import HOOK_PORT

if TYPE_CHECKING:
    from telemetry.hook.forecast.workload import ForecastWorkload

log = logging.getLogger("memtel.hook")

DEFAULT_PORT = HOOK_PORT  # MEMTEL_PORT's default (telemetry/scrape/ports.py)
FORECAST = ("forecast_tokens", "the live forecast")  # a bad MEMTEL_FORECAST_* value turns off the forecast only
DEFAULT_UNRESOLVED_AFTER_S = 300.0

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env(name: str, parse: Callable[[str, str], Any], *, turns_off: tuple[str, str] | None = None) -> dict[str, Any]:
    """Field metadata: the setting is read from environment variable `name` with `parse(name, text)`.

    turns_off: (field, feature): a bad value does not stop the hook, it logs one line and leaves `field`
    (the feature's switch) at its default, off.
    """
    return {"env": name, "parse": parse, "turns_off": turns_off}


def parse_flag(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={text!r} is not a boolean: expected 1/0, true/false, yes/no or on/off")


def parse_port(name: str, text: str) -> int | None:
    """A port in 1..65535 written in ASCII digits, or "off" (no exporter)."""
    value = text.strip()
    if value.lower() == "off":
        return None
    # str.isdigit() alone accepts other scripts' digits ("９２００", "٩٢٠٠"), which int() then reads.
    if not (value.isascii() and value.isdigit() and 0 < int(value) < 65536):
        raise ConfigError(f"{name}={text!r} is not a port: expected an integer in 1..65535 written in ASCII "
                          f'digits (each process listens on {hook_env.PORT} + its local rank) or "off"')
    return int(value)


def parse_text(name: str, text: str) -> str:
    return text.strip()


def parse_path(name: str, text: str) -> str:
    return text  # a path is taken as written (it may start or end with a space)


def parse_forecast_tokens(name: str, text: str) -> tuple[int, ...]:
    if text.strip().lower() == "off":
        return ()   # the forecast off where a known engine would turn it on
    return check_tokens(text, name)


# The live forecast's lengths where the engine is known (a target of a registered engine's preset, or the lab's
# ranks) and MEMTEL_FORECAST_TOKENS is unset: the guard's gauge exists without a variable (docs/hook.md). The
# lengths of docs/guard.md's lab node; their cycle's cost is in BENCHMARKS.md ("Live forecast").
DEFAULT_FORECAST_TOKENS = (32768, 100000, 1048576)


def _known_engine(targets: tuple[str, ...]) -> bool:
    """Whether a target is one a registered engine's preset names (vLLM, SGLang, the lab)."""
    from telemetry.hook.presets import PRESETS

    known = {site.target for sites in PRESETS.values() for site in sites}
    return any(target in known for target in targets)


def parse_forecast_interval(name: str, text: str) -> float:
    return check_interval(text, name)


def parse_forecast_shape(name: str, text: str) -> ForecastWorkload:
    from telemetry.hook.forecast.workload import workload_from_text

    return workload_from_text(text, name)


def parse_target_list(name: str, text: str) -> tuple[str, ...]:
    try:
        return tuple(t.name for t in parse_targets(text))
    except ConfigError as error:
        raise ConfigError(f"{name}: {error}") from None


@dataclass(frozen=True)
class HookConfig:
    """Everything the hook of one process is told. Frozen: built once, then only read."""

    # "package.module:function" / "package.module:Class.method" names; presets expanded (a comma-separated
    # string or a list is accepted and normalised).
    targets: tuple[str, ...] = field(metadata=env(hook_env.TARGETS, parse_target_list))
    # The exporter listens on port + local rank once the process records (None: no exporter).
    port: int | None = field(default=DEFAULT_PORT, metadata=env(hook_env.PORT, parse_port))
    addr: str = field(default="0.0.0.0", metadata=env(hook_env.ADDR, parse_text))
    # The exporter toolkit's web config file (TLS, basic auth) for the exporter; None: plain HTTP.
    web_config: str | None = field(default=None, metadata=env(hook_env.WEB_CONFIG, parse_path))
    # Directory of the per-call JSONL log (None: no log); created 0700 if missing, refused if unsafe.
    log_dir: str | None = field(default=None, metadata=env(hook_env.LOG_DIR, parse_path))
    # Add [rows, cols] of the first tensor argument to each record.
    record_shape: bool = field(default=False, metadata=env(hook_env.RECORD_SHAPE, parse_flag))
    flush_interval_s: float = 0.5   # the log's writer wakes at least this often
    flush_records: int = 4096       # and when this many records wait
    max_queue: int = 65536          # records waiting for the writer, at most; more are dropped and counted
    # Targets whose return means the model is loaded: targets still unresolved then are reported.
    model_loaded: tuple[str, ...] = ()
    # Targets whose return means the engine allocated its KV cache or captured its graphs (presets.ENGINE_MEMORY).
    engine_memory: tuple[str, ...] = ()
    # Also report unresolved targets this long after install (None: only at model_loaded).
    unresolved_after_s: float | None = DEFAULT_UNRESOLVED_AFTER_S
    # Also report them when a process makes its first hooked call (memtel run sets it: docs/hook.md).
    unresolved_at_first_call: bool = False
    node: str | None = None         # the `node` label and record field (None: the host name)
    meminfo_path: str = MEMINFO_PATH
    # The live forecast (docs/hook.md, "Live forecast"): prefill lengths in tokens (empty: off; a string
    # "100000,200000" is accepted), seconds between forecasts, and the indexer workload where the engine does
    # not give it (MEMTEL_FORECAST_SHAPE's text or a ForecastWorkload; None: the engine's or the reference).
    forecast_tokens: tuple[int, ...] = field(
        default=(), metadata=env(hook_env.FORECAST_TOKENS, parse_forecast_tokens, turns_off=FORECAST))
    forecast_interval_s: float = field(
        default=DEFAULT_INTERVAL_S,
        metadata=env(hook_env.FORECAST_INTERVAL_S, parse_forecast_interval, turns_off=FORECAST))
    forecast_shape: ForecastWorkload | None = field(
        default=None, metadata=env(hook_env.FORECAST_SHAPE, parse_forecast_shape, turns_off=FORECAST))

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise once, here
        set_(self, "targets", _target_names(self.targets, presets_allowed=True))
        set_(self, "model_loaded", _target_names(self.model_loaded, presets_allowed=False, empty_ok=True))
        set_(self, "engine_memory", _target_names(self.engine_memory, presets_allowed=False, empty_ok=True))
        port = self.port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
            raise ConfigError(f"port must be an integer in 1..65535 (or None for no exporter), got {port!r}")
        if not isinstance(self.addr, str) or not self.addr:
            raise ConfigError(f"addr must be a host name or address to bind, got {self.addr!r}")
        for name, what in (("log_dir", "a directory path (or None for no log)"),
                           ("web_config", "a web config file path (or None for plain HTTP)")):
            value = getattr(self, name)
            if value is not None:
                path = os.fspath(value)
                if not isinstance(path, str) or not path or "\0" in path:
                    raise ConfigError(f"{name} must be {what}, got {value!r}")
                set_(self, name, path)
        for name in ("record_shape", "unresolved_at_first_call"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("flush_records", "max_queue"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not _positive_seconds(self.flush_interval_s):
            raise ConfigError(f"flush_interval_s must be a positive number of seconds, got {self.flush_interval_s!r}")
        if self.unresolved_after_s is not None and not _positive_seconds(self.unresolved_after_s):
            raise ConfigError(f"unresolved_after_s must be a positive number of seconds or None, "
                              f"got {self.unresolved_after_s!r}")
        if self.node is not None and (not isinstance(self.node, str) or not self.node):
            raise ConfigError(f"node must be a non-empty name (or None for the host name), got {self.node!r}")
        set_(self, "forecast_tokens", check_tokens(self.forecast_tokens))
        set_(self, "forecast_interval_s", check_interval(self.forecast_interval_s))
        if isinstance(self.forecast_shape, str):
            set_(self, "forecast_shape", parse_forecast_shape("forecast_shape", self.forecast_shape))
        elif self.forecast_shape is not None:
            from telemetry.hook.forecast.workload import ForecastWorkload

            if not isinstance(self.forecast_shape, ForecastWorkload):
                raise ConfigError(f"forecast_shape must be {hook_env.FORECAST_SHAPE}'s key=value text or a "
                                  f"ForecastWorkload, got {self.forecast_shape!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **defaults: Any) -> HookConfig | None:
        """The configuration in `environ` (MEMTEL_*), None when the hook is off.

        Off unless MEMTEL_TARGETS is set (MEMTEL_ENABLE=0 turns it off anyway). `defaults` set the fields
        the environment does not name (the vLLM plugin's `model_loaded`). A bad value raises ConfigError
        naming the variable and what it expects.
        """
        targets = environ.get(hook_env.TARGETS, "")
        enable = environ.get(hook_env.ENABLE, "")
        if not (parse_flag(hook_env.ENABLE, enable) if enable.strip() else bool(targets.strip())):
            return None
        if not targets.strip():
            raise ConfigError(f"{hook_env.ENABLE} is on but {hook_env.TARGETS} is empty: expected comma-separated "
                              '"package.module:function" targets or preset names')
        values = _env_values(environ, fields(cls))
        if "forecast_tokens" not in values and not environ.get(hook_env.FORECAST_TOKENS, "").strip() \
                and "forecast_tokens" not in defaults and _known_engine(values.get("targets", ())):
            values["forecast_tokens"] = DEFAULT_FORECAST_TOKENS   # a known engine: the forecast on by default
        return cls(**{**defaults, **values})

    def options(self) -> dict[str, Any]:
        """Every setting but the targets (two installs in one process must agree on these)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "targets"}


ENV_VARIABLES = (hook_env.ENABLE, *(f.metadata["env"] for f in fields(HookConfig) if "env" in f.metadata))


def _env_values(environ: Mapping[str, str], settings: Iterable[Any]) -> dict[str, Any]:
    """The values `environ` gives `settings` (dataclass fields with `env` metadata). A bad value raises
    ConfigError, or, for a setting that `turns_off` a feature, logs one line and leaves that feature off."""
    values: dict[str, Any] = {}
    turned_off: set[str] = set()
    for setting in settings:
        name = setting.metadata.get("env")
        text = environ.get(name, "") if name else ""
        if text.strip():
            try:
                values[setting.name] = setting.metadata["parse"](name, text)
            except ConfigError as error:
                if setting.metadata.get("turns_off") is None:
                    raise
                switch, feature = setting.metadata["turns_off"]
                log.error("memtel: %s; %s is off (the rest of the hook is not affected)", error, feature)
                turned_off.add(switch)
    for switch in turned_off:
        values.pop(switch, None)   # back to its default: off
    return values


def forecast_options(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The live forecast's settings in `environ` (MEMTEL_FORECAST_*) as `install()` options, for programs that
    install the hook with options (the lab server's ranks): DEFAULT_FORECAST_TOKENS unless MEMTEL_FORECAST_TOKENS
    says otherwise; {} when off (MEMTEL_FORECAST_TOKENS=off). Never raises: a bad value is one
    log line and the forecast off."""
    settings = [f for f in fields(HookConfig) if f.metadata.get("turns_off") == FORECAST]
    values = _env_values(environ, settings)
    if "forecast_tokens" not in values and not environ.get(hook_env.FORECAST_TOKENS, "").strip():
        values["forecast_tokens"] = DEFAULT_FORECAST_TOKENS   # the lab is a known engine: on by default
    return values if values.get("forecast_tokens") else {}


def _positive_seconds(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def _target_names(value: object, *, presets_allowed: bool, empty_ok: bool = False) -> tuple[str, ...]:
    if isinstance(value, (str, list, tuple)) and not value and empty_ok:
        return ()
    if not isinstance(value, (str, Iterable)):
        raise ConfigError(f"targets must be a list of target names or one comma-separated string, got {value!r}")
    if presets_allowed:
        return tuple(t.name for t in parse_targets(value))
    items = value.split(",") if isinstance(value, str) else list(value)
    return tuple(dict.fromkeys(parse_target(item).name for item in items if item != ""))


__all__ = ["DEFAULT_FORECAST_TOKENS", "DEFAULT_PORT", "ENV_VARIABLES", "HookConfig", "env", "forecast_options",
           "parse_flag", "parse_port"]
