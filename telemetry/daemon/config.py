"""Typed daemon configuration from flags and an optional YAML file (flags win).

Every section and key is checked: an unknown key is an error that lists the valid ones, a bad
value says what was expected, a bad regular expression names its pattern. Every number must be
finite and within documented bounds (`LIMITS`), so no value can ask for unbounded memory or time.
See configs/examples/daemon.yaml for a commented example of every key.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from telemetry.daemon.collectors import NAMES as COLLECTOR_NAMES
from telemetry.daemon.collectors.processes import DEFAULT_ROLES, RolePattern
from telemetry.daemon.kmsg.classify import UserPattern
from telemetry.daemon.patterns import compile_user_pattern
from telemetry.errors import ConfigError
from telemetry.exporter.address import parse_listen as _parse_listen
from telemetry.paths import default_state_dir

DEFAULT_LISTEN = "0.0.0.0:9101"  # next to node_exporter's 9100, far from dcgm-exporter's 9400
LOG_LEVELS = ("debug", "info", "warning", "error")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
MAX_PATTERNS = 64
MAX_ROLES = 32
MAX_PATH_CHARS = 4096
# key -> (lowest, highest): every number a config file or flag can set.
LIMITS: dict[str, tuple[float, float]] = {
    "kmsg.burst_window_seconds": (0.0, 3600.0),
    "kmsg.max_xid_codes": (1, 1024),
    "nvml.max_processes": (1, 1024),
    "processes.max_per_role": (1, 1024),
    "processes.recheck_seconds": (0.0, 86400.0),
    "flight.duration_seconds": (10.0, 7 * 86400.0),
    "flight.interval_seconds": (0.01, 60.0),
}
MAX_FLIGHT_RECORDS = 100_000  # flight.duration_seconds / flight.interval_seconds: the ring's slots
MAX_HOOK_TARGETS = 16


@dataclass(frozen=True)
class KmsgConfig:
    path: str = "/dev/kmsg"
    burst_window_seconds: float = 2.0
    max_xid_codes: int = 32
    patterns: tuple[UserPattern, ...] = ()
    # Lines that start with the test-suite marker (TEST_LINE_MARKER) are read but not classified, so
    # memtel's own tests, run on a monitored box, raise nothing; the tests' own daemons count them.
    ignore_test_lines: bool = True


@dataclass(frozen=True)
class ProcessesConfig:
    roles: tuple[RolePattern, ...] = DEFAULT_ROLES
    max_per_role: int = 8
    recheck_seconds: float = 60.0


@dataclass(frozen=True)
class NvmlConfig:
    max_processes: int = 32


@dataclass(frozen=True)
class FlightConfig:
    """The flight recorder (docs/flight-recorder.md). `enabled` None: on when a state directory is given."""

    enabled: bool | None = None
    duration_seconds: float = 900.0
    interval_seconds: float = 1.0
    hook_targets: tuple[str, ...] = ()  # local hook exporters (HOST:PORT) whose last values each record keeps


@dataclass(frozen=True)
class DaemonConfig:
    listen_host: str = "0.0.0.0"
    listen_port: int = 9101
    state_dir: Path = field(default_factory=default_state_dir)
    web_config: str | None = None  # the Prometheus exporter toolkit's web config file (TLS, basic auth)
    proc_root: Path = Path("/proc")  # the host's /proc when the daemon runs in a container (e.g. /host/proc)
    log_level: str = "info"
    disabled_collectors: tuple[str, ...] = ()
    kmsg: KmsgConfig = KmsgConfig()
    processes: ProcessesConfig = ProcessesConfig()
    nvml: NvmlConfig = NvmlConfig()
    flight: FlightConfig = FlightConfig()
    state_dir_given: bool = False  # --state-dir, state_dir or $STATE_DIRECTORY: turns the flight recorder on

    @property
    def flight_enabled(self) -> bool:
        return self.state_dir_given if self.flight.enabled is None else self.flight.enabled

    @property
    def enabled_collectors(self) -> tuple[str, ...]:
        return tuple(name for name in COLLECTOR_NAMES if name not in self.disabled_collectors)


# -- value checks -------------------------------------------------------------------------------------
def parse_listen(text: Any, where: str = "--listen") -> tuple[str, int]:
    return _parse_listen(text, where)


def _keys(section: Any, allowed: tuple[str, ...], where: str) -> dict[str, Any]:
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: expected a mapping with keys {', '.join(allowed)}, got {type(section).__name__}")
    unknown = sorted({str(k)[:64] for k in section} - set(allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(allowed)}")
    return section


def _number(value: Any, where: str, *, integer: bool = False, key: str | None = None) -> Any:
    """A finite number within LIMITS[key] (or >= 0 without a key); ConfigError otherwise."""
    low, high = LIMITS.get(key or "", (0.0, math.inf))
    kind = int if integer else (int, float)
    what = "an integer" if integer else "a number"
    bounds = f"from {low:g} to {high:g}" if math.isfinite(high) else f">= {low:g}"
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"{where}: expected {what} {bounds}, got {_short(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: expected a finite number {bounds}, got {value!r}")
    if not low <= value <= high:
        raise ConfigError(f"{where}: expected {what} {bounds}, got {_short(value)}")
    return value


def _short(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**18:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _path(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_PATH_CHARS or "\0" in value:
        raise ConfigError(f"{where}: expected a path, got {_short(value)}")
    return value


def _regex(text: Any, where: str) -> Any:
    return compile_user_pattern(text, where)


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ConfigError(f"{where}: {_short(value)} is not a name (letters, digits and _, not starting with a digit, "
                          "at most 64 characters)")
    return value


def check_collectors(names: Any, where: str) -> tuple[str, ...]:
    if not isinstance(names, (list, tuple)):
        raise ConfigError(f"{where}: expected a list of collector names ({', '.join(COLLECTOR_NAMES)})")
    for name in names:
        if not isinstance(name, str) or name not in COLLECTOR_NAMES:
            raise ConfigError(f"{where}: unknown collector {_short(name)}; valid: {', '.join(COLLECTOR_NAMES)}")
    return tuple(names)


# -- sections -----------------------------------------------------------------------------------------
def _kmsg(section: Any, base: KmsgConfig) -> KmsgConfig:
    data = _keys(section, ("path", "burst_window_seconds", "max_xid_codes", "patterns", "ignore_test_lines"), "kmsg")
    patterns = list(base.patterns)
    raw_patterns = data.get("patterns", [])
    if raw_patterns is None:
        raw_patterns = []
    if not isinstance(raw_patterns, list):
        raise ConfigError("kmsg.patterns: expected a list of {name, regex} mappings")
    if len(raw_patterns) > MAX_PATTERNS:
        raise ConfigError(f"kmsg.patterns: {len(raw_patterns)} patterns; at most {MAX_PATTERNS} are accepted")
    seen: set[str] = set()
    for i, item in enumerate(raw_patterns):
        where = f"kmsg.patterns[{i}]"
        entry = _keys(item, ("name", "regex"), where)
        if "name" not in entry or "regex" not in entry:
            raise ConfigError(f"{where}: needs both 'name' and 'regex'")
        name = _name(entry["name"], f"{where}.name")
        if name in seen:
            raise ConfigError(f"{where}.name: pattern {name!r} is defined twice")
        seen.add(name)
        patterns.append(UserPattern(name, _regex(entry["regex"], f"{where}.regex ({name})")))
    path = _path(data.get("path", base.path), "kmsg.path")
    ignore = data.get("ignore_test_lines", base.ignore_test_lines)
    if not isinstance(ignore, bool):
        raise ConfigError(f"kmsg.ignore_test_lines: expected true or false, got {_short(ignore)}")
    return KmsgConfig(
        path=path,
        burst_window_seconds=float(_number(data.get("burst_window_seconds", base.burst_window_seconds),
                                           "kmsg.burst_window_seconds", key="kmsg.burst_window_seconds")),
        max_xid_codes=_number(data.get("max_xid_codes", base.max_xid_codes), "kmsg.max_xid_codes",
                              integer=True, key="kmsg.max_xid_codes"),
        patterns=tuple(patterns),
        ignore_test_lines=ignore,
    )


def _processes(section: Any) -> ProcessesConfig:
    data = _keys(section, ("roles", "max_per_role", "recheck_seconds"), "processes")
    roles: tuple[RolePattern, ...] = DEFAULT_ROLES
    if "roles" in data:
        if not isinstance(data["roles"], list) or not data["roles"] or len(data["roles"]) > MAX_ROLES:
            raise ConfigError(f"processes.roles: expected a list of 1 to {MAX_ROLES} {{role, cmdline}} mappings")
        parsed = []
        for i, item in enumerate(data["roles"]):
            where = f"processes.roles[{i}]"
            entry = _keys(item, ("role", "cmdline"), where)
            if "role" not in entry or "cmdline" not in entry:
                raise ConfigError(f"{where}: needs both 'role' and 'cmdline'")
            parsed.append(RolePattern(_name(entry["role"], f"{where}.role"),
                                      _regex(entry["cmdline"], f"{where}.cmdline")))
        roles = tuple(parsed)
    return ProcessesConfig(
        roles=roles,
        max_per_role=_number(data.get("max_per_role", 8), "processes.max_per_role", integer=True,
                             key="processes.max_per_role"),
        recheck_seconds=float(_number(data.get("recheck_seconds", 60.0), "processes.recheck_seconds",
                                      key="processes.recheck_seconds")),
    )


def _flight(section: Any) -> FlightConfig:
    data = _keys(section, ("enabled", "duration_seconds", "interval_seconds", "hook_targets"), "flight")
    enabled = data.get("enabled")
    if enabled is not None and not isinstance(enabled, bool):
        raise ConfigError(f"flight.enabled: expected true or false, got {_short(enabled)}")
    targets = data.get("hook_targets") or []
    if not isinstance(targets, list) or len(targets) > MAX_HOOK_TARGETS:
        raise ConfigError(f"flight.hook_targets: expected a list of at most {MAX_HOOK_TARGETS} HOST:PORT targets")
    for i, target in enumerate(targets):
        parse_listen(target, f"flight.hook_targets[{i}]")
    return _flight_durations(FlightConfig(
        enabled=enabled,
        duration_seconds=float(_number(data.get("duration_seconds", 900.0), "flight.duration_seconds",
                                       key="flight.duration_seconds")),
        interval_seconds=float(_number(data.get("interval_seconds", 1.0), "flight.interval_seconds",
                                       key="flight.interval_seconds")),
        hook_targets=tuple(targets),
    ))


def _flight_durations(flight: FlightConfig) -> FlightConfig:
    records = math.ceil(flight.duration_seconds / flight.interval_seconds)
    if records > MAX_FLIGHT_RECORDS:
        raise ConfigError(f"flight: a ring of {flight.duration_seconds:g} s at one record every "
                          f"{flight.interval_seconds:g} s holds {records} records; at most {MAX_FLIGHT_RECORDS}")
    return flight


TOP_KEYS = ("listen", "web_config", "state_dir", "proc_root", "log_level", "collectors", "kmsg", "processes", "nvml",
            "flight")


def from_mapping(data: Any, source: str = "config") -> DaemonConfig:
    """Build a config from a parsed YAML mapping; ConfigError names the file and the key."""
    try:
        top = _keys(data, TOP_KEYS, "top level")
        host, port = parse_listen(top.get("listen", DEFAULT_LISTEN), "listen")
        log_level = top.get("log_level", "info")
        if not isinstance(log_level, str) or log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level: {_short(log_level)}; valid: {', '.join(LOG_LEVELS)}")
        collectors = _keys(top.get("collectors"), ("disabled",), "collectors")
        nvml = _keys(top.get("nvml"), ("max_processes",), "nvml")
        state_dir = top.get("state_dir")
        if state_dir is not None:
            state_dir = _path(state_dir, "state_dir")
        web_config = top.get("web_config")
        if web_config is not None:
            web_config = _path(web_config, "web_config")
        proc_root = _path(top.get("proc_root", "/proc"), "proc_root")
        return DaemonConfig(
            web_config=web_config,
            proc_root=Path(proc_root),
            listen_host=host,
            listen_port=port,
            state_dir=Path(state_dir) if state_dir else default_state_dir(),
            log_level=log_level,
            disabled_collectors=check_collectors(collectors.get("disabled", []), "collectors.disabled"),
            kmsg=_kmsg(top.get("kmsg"), KmsgConfig()),
            processes=_processes(top.get("processes")),
            nvml=NvmlConfig(max_processes=_number(nvml.get("max_processes", 32), "nvml.max_processes",
                                                  integer=True, key="nvml.max_processes")),
            flight=_flight(top.get("flight")),
            state_dir_given=state_dir is not None or bool(os.environ.get("STATE_DIRECTORY")),
        )
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def load_file(path: str | Path) -> DaemonConfig:
    from telemetry.safeyaml import load_yaml_file

    data = load_yaml_file(path, "config file")
    return from_mapping({} if data is None else data, str(path))


def check_proc_root(proc_root: Path) -> None:
    """Refuse a --proc-root that is not a /proc (every collector would fail instead)."""
    if not (proc_root / "meminfo").is_file():
        what = "does not exist" if not proc_root.exists() else "has no meminfo file"
        raise ConfigError(f"--proc-root {proc_root} {what}; expected the host's /proc (e.g. /proc or /host/proc)")


def from_args(args: Any) -> DaemonConfig:
    """Combine `--config FILE` (if any) with the flags; flags given on the command line win."""
    config = load_file(args.config) if args.config else from_mapping({})
    changes: dict[str, Any] = {}
    if args.listen is not None:
        changes["listen_host"], changes["listen_port"] = parse_listen(args.listen)
    if args.state_dir is not None:
        changes["state_dir"] = Path(_path(args.state_dir, "--state-dir"))
        changes["state_dir_given"] = True
    if getattr(args, "web_config", None) is not None:
        changes["web_config"] = _path(args.web_config, "--web-config")
    if args.proc_root is not None:
        changes["proc_root"] = Path(_path(args.proc_root, "--proc-root"))
    if args.log_level is not None:
        changes["log_level"] = args.log_level
    if args.disable_collector:
        changes["disabled_collectors"] = tuple(
            dict.fromkeys(config.disabled_collectors + check_collectors(args.disable_collector, "--disable-collector"))
        )
    kmsg_changes: dict[str, Any] = {}
    if args.kmsg is not None:
        kmsg_changes["path"] = _path(args.kmsg, "--kmsg")
    if args.burst_window is not None:
        kmsg_changes["burst_window_seconds"] = float(_number(args.burst_window, "--burst-window",
                                                             key="kmsg.burst_window_seconds"))
    if getattr(args, "kmsg_count_test_lines", False):
        kmsg_changes["ignore_test_lines"] = False
    if len(args.kmsg_pattern or ()) + len(config.kmsg.patterns) > MAX_PATTERNS:
        raise ConfigError(f"--kmsg-pattern: more than {MAX_PATTERNS} patterns in all")
    for spec in args.kmsg_pattern or ():
        name, sep, regex = spec.partition("=")
        if not sep:
            raise ConfigError(f"--kmsg-pattern {spec!r}: expected NAME=REGEX")
        existing = {p.name for p in config.kmsg.patterns} | {p.name for p in kmsg_changes.get("patterns", ())}
        if name in existing:
            raise ConfigError(f"--kmsg-pattern {spec!r}: pattern {name!r} is defined twice")
        pattern = UserPattern(_name(name, f"--kmsg-pattern {spec!r}"), _regex(regex, f"--kmsg-pattern {spec!r}"))
        kmsg_changes["patterns"] = (*kmsg_changes.get("patterns", config.kmsg.patterns), pattern)
    if kmsg_changes:
        changes["kmsg"] = KmsgConfig(**{**config.kmsg.__dict__, **kmsg_changes})
    flight_changes: dict[str, Any] = {}
    if getattr(args, "no_flight_recorder", False):
        flight_changes["enabled"] = False
    if getattr(args, "flight_duration", None) is not None:
        from telemetry.flight.duration import parse_duration

        flight_changes["duration_seconds"] = float(_number(parse_duration(args.flight_duration, "--flight-duration"),
                                                           "--flight-duration", key="flight.duration_seconds"))
    if flight_changes:
        changes["flight"] = _flight_durations(FlightConfig(**{**config.flight.__dict__, **flight_changes}))
    return DaemonConfig(**{**config.__dict__, **changes}) if changes else config
