"""Typed daemon configuration from flags and an optional YAML file (flags win).

The values are telemetry/daemon/settings.py's dataclasses; this module checks and builds them, and knows the
registered collectors' names (a `collectors.disabled` entry or `--disable-collector` is checked against them).

Every section and key is checked: an unknown key is an error that lists the valid ones, a bad
value says what was expected, a bad regular expression names its pattern. Every number must be
finite and within documented bounds (`LIMITS`), so no value can ask for unbounded memory or time.
See configs/examples/daemon.yaml for a commented example of every key.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from telemetry.argtypes import LOG_LEVELS
from telemetry.daemon.collectors import NAMES as COLLECTOR_NAMES
from telemetry.daemon.kmsg.classify import UserPattern
from telemetry.daemon.patterns import compile_user_pattern
from telemetry.daemon.protect import ProtectConfig, parse_protect
from telemetry.daemon.settings import DaemonConfig, FlightConfig, KmsgConfig, NvmlConfig, ProcessesConfig, RolePattern
from telemetry.errors import ConfigError
from telemetry.exporter.address import parse_listen as _parse_listen
from telemetry.paths import default_state_dir
from telemetry.scrape.ports import DAEMON_PORT
from telemetry.url import parse_url
from telemetry.validate import DAEMON, Check, Field, Section, Validator, boolean, optional, path_text

DEFAULT_LISTEN = f"0.0.0.0:{DAEMON_PORT}"  # every interface, on the daemon's port (telemetry/scrape/ports.py)
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


def enabled_collectors(config: DaemonConfig) -> tuple[str, ...]:
    """The collectors `config` leaves on, in scrape order (the registry's names less `disabled_collectors`)."""
    return tuple(name for name in COLLECTOR_NAMES if name not in config.disabled_collectors)


# -- value checks (telemetry/validate.py; a flag's value is checked like the file's key it overrides) ----
FLAGS = Validator(None, wording=DAEMON)


def parse_listen(text: Any, where: str = "--listen") -> tuple[str, int]:
    return _parse_listen(text, where)


def _short(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**18:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _limited(key: str, *, whole: bool = False) -> Check[Any]:
    """A number (an integer if `whole`) within LIMITS[key]."""
    low, high = LIMITS[key]
    if whole:
        return lambda v, value, path: v.integer(value, path, int(low), int(high))
    return lambda v, value, path: v.number(value, path, low, high)


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


def _named_patterns(v: Validator, value: Any, path: str, *, name_key: str, pattern_key: str, max_items: int,
                    required: bool, unique: bool) -> list[tuple[str, Any]]:
    """A list of {name_key, pattern_key} mappings: (name, compiled pattern) pairs (names unique if `unique`)."""
    if not isinstance(value, list) or (required and not value) or len(value) > max_items:
        size = f"1 to {max_items}" if required else f"at most {max_items}"
        raise v.fail(path, f"expected a list of {size} {{{name_key}, {pattern_key}}} mappings")
    pairs: list[tuple[str, Any]] = []
    for i, item in enumerate(value):
        where = f"{path}[{i}]"
        data = v.mapping(item, where, (), (name_key, pattern_key))
        if name_key not in data or pattern_key not in data:
            raise v.fail(where, f"needs both {name_key!r} and {pattern_key!r}")
        name = _name(data[name_key], f"{where}.{name_key}")
        if unique and name in (n for n, _ in pairs):
            raise v.fail(f"{where}.{name_key}", f"pattern {name!r} is defined twice")
        label = f" ({name})" if name_key == "name" else ""
        pairs.append((name, compile_user_pattern(data[pattern_key], f"{where}.{pattern_key}{label}")))
    return pairs


def _kmsg_patterns(v: Validator, value: Any, path: str) -> tuple[UserPattern, ...]:
    if isinstance(value, list) and len(value) > MAX_PATTERNS:
        raise v.fail(path, f"{len(value)} patterns; at most {MAX_PATTERNS} are accepted")
    pairs = _named_patterns(v, value, path, name_key="name", pattern_key="regex", max_items=MAX_PATTERNS,
                            required=False, unique=True)
    return tuple(UserPattern(name, regex) for name, regex in pairs)


def _roles(v: Validator, value: Any, path: str) -> tuple[RolePattern, ...]:
    pairs = _named_patterns(v, value, path, name_key="role", pattern_key="cmdline", max_items=MAX_ROLES,
                            required=True, unique=False)
    return tuple(RolePattern(role, cmdline) for role, cmdline in pairs)


def _hook_targets(v: Validator, value: Any, path: str) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_HOOK_TARGETS:
        raise v.fail(path, f"expected a list of at most {MAX_HOOK_TARGETS} HOST:PORT targets")
    for i, target in enumerate(value):
        if not isinstance(target, str):
            raise v.fail(f"{path}[{i}]", "expected HOST:PORT or http(s)://HOST:PORT[/PATH]")
        parse_url(target, f"{path}[{i}]")  # telemetry/url.py: its refusals never quote a password
    return tuple(value)


def _log_level(v: Validator, value: Any, path: str) -> str:
    if not isinstance(value, str) or value not in LOG_LEVELS:
        raise v.fail(path, f"{_short(value)}; valid: {', '.join(LOG_LEVELS)}")
    return value


# -- sections: each key with its check and its default (the dataclasses' defaults) --------------------
KMSG = Section({
    "path": Field(path_text, KmsgConfig.path),
    "burst_window_seconds": Field(_limited("kmsg.burst_window_seconds"), KmsgConfig.burst_window_seconds),
    "max_xid_codes": Field(_limited("kmsg.max_xid_codes", whole=True), KmsgConfig.max_xid_codes),
    "patterns": Field(_kmsg_patterns, KmsgConfig.patterns, null_is_default=True),
    "ignore_test_lines": Field(boolean, KmsgConfig.ignore_test_lines),
})
PROCESSES = Section({
    "roles": Field(_roles, ProcessesConfig.roles),
    "max_per_role": Field(_limited("processes.max_per_role", whole=True), ProcessesConfig.max_per_role),
    "recheck_seconds": Field(_limited("processes.recheck_seconds"), ProcessesConfig.recheck_seconds),
})
NVML = Section({
    "max_processes": Field(_limited("nvml.max_processes", whole=True), NvmlConfig.max_processes),
})
FLIGHT = Section({
    "enabled": Field(optional(boolean), FlightConfig.enabled),
    "duration_seconds": Field(_limited("flight.duration_seconds"), FlightConfig.duration_seconds),
    "interval_seconds": Field(_limited("flight.interval_seconds"), FlightConfig.interval_seconds),
    "hook_targets": Field(_hook_targets, FlightConfig.hook_targets, null_is_default=True),
})
COLLECTORS = Section({
    "disabled": Field(lambda v, value, path: check_collectors(value, path), ()),
})
TOP = Section({
    "listen": Field(lambda v, value, path: parse_listen(value, path), parse_listen(DEFAULT_LISTEN)),
    "web_config": Field(optional(path_text), None),
    "state_dir": Field(optional(path_text), None),
    "proc_root": Field(path_text, "/proc"),
    "log_level": Field(_log_level, DaemonConfig.log_level),
    "collectors": Field(COLLECTORS.read, {"disabled": ()}),
    "kmsg": Field(KMSG.read, {}),
    "processes": Field(PROCESSES.read, {}),
    "nvml": Field(NVML.read, {}),
    "flight": Field(FLIGHT.read, {}),
    "protect": Field(parse_protect, ProtectConfig()),
})
TOP_KEYS = TOP.keys


def _flight_durations(flight: FlightConfig) -> FlightConfig:
    records = math.ceil(flight.duration_seconds / flight.interval_seconds)
    if records > MAX_FLIGHT_RECORDS:
        raise ConfigError(f"flight: a ring of {flight.duration_seconds:g} s at one record every "
                          f"{flight.interval_seconds:g} s holds {records} records; at most {MAX_FLIGHT_RECORDS}")
    return flight


def _protect_role(protect: ProtectConfig, roles: tuple[RolePattern, ...]) -> ProtectConfig:
    """A protect role target names one of the process collector's roles (checked at load, not at the collapse)."""
    names = [role.role for role in roles]
    if protect.target_kind == "role" and protect.target not in names:
        raise ConfigError(f"protect.role: {_short(protect.target)} is not one of the process collector's roles "
                          f"({', '.join(names) or 'none configured'}; processes.roles defines them)")
    return protect


def from_mapping(data: Any, source: str = "config") -> DaemonConfig:
    """Build a config from a parsed YAML mapping; ConfigError names the file and the key."""
    try:
        top = TOP.read(Validator(None, wording=DAEMON, top="top level"), data, "")
        (host, port), state_dir = top["listen"], top["state_dir"]
        return DaemonConfig(
            web_config=top["web_config"],
            proc_root=Path(top["proc_root"]),
            listen_host=host,
            listen_port=port,
            state_dir=Path(state_dir) if state_dir else default_state_dir(),
            log_level=top["log_level"],
            disabled_collectors=top["collectors"]["disabled"],
            kmsg=KmsgConfig(**top["kmsg"]),
            processes=ProcessesConfig(**top["processes"]),
            nvml=NvmlConfig(**top["nvml"]),
            flight=_flight_durations(FlightConfig(**top["flight"])),
            protect=_protect_role(top["protect"], top["processes"].get("roles", ProcessesConfig.roles)),
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
        changes["state_dir"] = Path(FLAGS.path_text(args.state_dir, "--state-dir"))
        changes["state_dir_given"] = True
    if getattr(args, "web_config", None) is not None:
        changes["web_config"] = FLAGS.path_text(args.web_config, "--web-config")
    if args.proc_root is not None:
        changes["proc_root"] = Path(FLAGS.path_text(args.proc_root, "--proc-root"))
    if args.log_level is not None:
        changes["log_level"] = args.log_level
    if args.disable_collector:
        changes["disabled_collectors"] = tuple(
            dict.fromkeys(config.disabled_collectors + check_collectors(args.disable_collector, "--disable-collector"))
        )
    kmsg_changes: dict[str, Any] = {}
    if args.kmsg is not None:
        kmsg_changes["path"] = FLAGS.path_text(args.kmsg, "--kmsg")
    if args.burst_window is not None:
        kmsg_changes["burst_window_seconds"] = FLAGS.number(args.burst_window, "--burst-window",
                                                      *LIMITS["kmsg.burst_window_seconds"])
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
        where = f"--kmsg-pattern {spec!r}"
        pattern = UserPattern(_name(name, where), compile_user_pattern(regex, where))
        kmsg_changes["patterns"] = (*kmsg_changes.get("patterns", config.kmsg.patterns), pattern)
    if kmsg_changes:
        changes["kmsg"] = KmsgConfig(**{**config.kmsg.__dict__, **kmsg_changes})
    flight_changes: dict[str, Any] = {}
    if getattr(args, "no_flight_recorder", False):
        flight_changes["enabled"] = False
    if getattr(args, "flight_duration", None) is not None:
        from telemetry.flight.duration import parse_duration

        flight_changes["duration_seconds"] = FLAGS.number(parse_duration(args.flight_duration, "--flight-duration"),
                                                    "--flight-duration", *LIMITS["flight.duration_seconds"])
    if flight_changes:
        changes["flight"] = _flight_durations(FlightConfig(**{**config.flight.__dict__, **flight_changes}))
    return DaemonConfig(**{**config.__dict__, **changes}) if changes else config
