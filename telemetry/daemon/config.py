"""Typed daemon configuration from flags and an optional YAML file (flags win).

Every section and key is checked: an unknown key is an error that lists the valid ones, a bad
value says what was expected, a bad regular expression names its pattern. See
configs/examples/daemon.yaml for a commented example of every key.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from telemetry.daemon.collectors import NAMES as COLLECTOR_NAMES
from telemetry.daemon.collectors.processes import DEFAULT_ROLES, RolePattern
from telemetry.daemon.kmsg.classify import UserPattern

DEFAULT_LISTEN = "0.0.0.0:9101"  # next to node_exporter's 9100, far from dcgm-exporter's 9400
LOG_LEVELS = ("debug", "info", "warning", "error")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ConfigError(ValueError):
    """A configuration problem, with a message that says what is wrong and what is expected."""


def default_state_dir() -> Path:
    # systemd's StateDirectory= sets STATE_DIRECTORY; root uses /var/lib; anyone else their XDG state dir.
    if os.environ.get("STATE_DIRECTORY"):
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
    if os.geteuid() == 0:
        return Path("/var/lib/memtel")
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "memtel"


@dataclass(frozen=True)
class KmsgConfig:
    path: str = "/dev/kmsg"
    burst_window_seconds: float = 2.0
    max_xid_codes: int = 32
    patterns: tuple[UserPattern, ...] = ()


@dataclass(frozen=True)
class ProcessesConfig:
    roles: tuple[RolePattern, ...] = DEFAULT_ROLES
    max_per_role: int = 8
    recheck_seconds: float = 60.0


@dataclass(frozen=True)
class NvmlConfig:
    max_processes: int = 32


@dataclass(frozen=True)
class DaemonConfig:
    listen_host: str = "0.0.0.0"
    listen_port: int = 9101
    state_dir: Path = field(default_factory=default_state_dir)
    proc_root: Path = Path("/proc")  # the host's /proc when the daemon runs in a container (e.g. /host/proc)
    log_level: str = "info"
    disabled_collectors: tuple[str, ...] = ()
    kmsg: KmsgConfig = KmsgConfig()
    processes: ProcessesConfig = ProcessesConfig()
    nvml: NvmlConfig = NvmlConfig()

    @property
    def enabled_collectors(self) -> tuple[str, ...]:
        return tuple(name for name in COLLECTOR_NAMES if name not in self.disabled_collectors)


# -- value checks -------------------------------------------------------------------------------------
def parse_listen(text: str, where: str = "--listen") -> tuple[str, int]:
    host, sep, port_text = str(text).rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise ConfigError(f"{where}: {text!r} is not HOST:PORT (expected e.g. 0.0.0.0:9101 or 127.0.0.1:9101)")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port_text)


def _keys(section: Any, allowed: tuple[str, ...], where: str) -> dict[str, Any]:
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: expected a mapping with keys {', '.join(allowed)}, got {type(section).__name__}")
    unknown = sorted(set(map(str, section)) - set(allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(allowed)}")
    return section


def _number(value: Any, where: str, *, integer: bool = False, minimum: float = 0.0) -> Any:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or value < minimum:
        what = "an integer" if integer else "a number"
        raise ConfigError(f"{where}: expected {what} >= {minimum:g}, got {value!r}")
    return value


def _regex(text: Any, where: str) -> re.Pattern[str]:
    if not isinstance(text, str) or not text:
        raise ConfigError(f"{where}: expected a regular expression (a non-empty string), got {text!r}")
    try:
        return re.compile(text)
    except re.error as exc:
        raise ConfigError(f"{where}: bad regular expression {text!r}: {exc}") from None


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ConfigError(f"{where}: {value!r} is not a name (letters, digits and _, not starting with a digit)")
    return value


def check_collectors(names: Any, where: str) -> tuple[str, ...]:
    if not isinstance(names, (list, tuple)):
        raise ConfigError(f"{where}: expected a list of collector names ({', '.join(COLLECTOR_NAMES)})")
    for name in names:
        if name not in COLLECTOR_NAMES:
            raise ConfigError(f"{where}: unknown collector {name!r}; valid: {', '.join(COLLECTOR_NAMES)}")
    return tuple(names)


# -- sections -----------------------------------------------------------------------------------------
def _kmsg(section: Any, base: KmsgConfig) -> KmsgConfig:
    data = _keys(section, ("path", "burst_window_seconds", "max_xid_codes", "patterns"), "kmsg")
    patterns = list(base.patterns)
    raw_patterns = data.get("patterns", [])
    if not isinstance(raw_patterns, list):
        raise ConfigError("kmsg.patterns: expected a list of {name, regex} mappings")
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
    path = data.get("path", base.path)
    if not isinstance(path, str) or not path:
        raise ConfigError(f"kmsg.path: expected a path, got {path!r}")
    return KmsgConfig(
        path=path,
        burst_window_seconds=float(_number(data.get("burst_window_seconds", base.burst_window_seconds),
                                           "kmsg.burst_window_seconds")),
        max_xid_codes=_number(data.get("max_xid_codes", base.max_xid_codes), "kmsg.max_xid_codes",
                              integer=True, minimum=1),
        patterns=tuple(patterns),
    )


def _processes(section: Any) -> ProcessesConfig:
    data = _keys(section, ("roles", "max_per_role", "recheck_seconds"), "processes")
    roles = DEFAULT_ROLES
    if "roles" in data:
        if not isinstance(data["roles"], list) or not data["roles"]:
            raise ConfigError("processes.roles: expected a non-empty list of {role, cmdline} mappings")
        parsed = []
        for i, item in enumerate(data["roles"]):
            where = f"processes.roles[{i}]"
            entry = _keys(item, ("role", "cmdline"), where)
            if "role" not in entry or "cmdline" not in entry:
                raise ConfigError(f"{where}: needs both 'role' and 'cmdline'")
            parsed.append(RolePattern(_name(entry["role"], f"{where}.role"), _regex(entry["cmdline"], f"{where}.cmdline")))
        roles = tuple(parsed)
    return ProcessesConfig(
        roles=roles,
        max_per_role=_number(data.get("max_per_role", 8), "processes.max_per_role", integer=True, minimum=1),
        recheck_seconds=float(_number(data.get("recheck_seconds", 60.0), "processes.recheck_seconds")),
    )


TOP_KEYS = ("listen", "state_dir", "proc_root", "log_level", "collectors", "kmsg", "processes", "nvml")


def from_mapping(data: Any, source: str = "config") -> DaemonConfig:
    """Build a config from a parsed YAML mapping; ConfigError names the file and the key."""
    try:
        top = _keys(data, TOP_KEYS, "top level")
        host, port = parse_listen(top.get("listen", DEFAULT_LISTEN), "listen")
        log_level = top.get("log_level", "info")
        if log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level: {log_level!r}; valid: {', '.join(LOG_LEVELS)}")
        collectors = _keys(top.get("collectors"), ("disabled",), "collectors")
        nvml = _keys(top.get("nvml"), ("max_processes",), "nvml")
        state_dir = top.get("state_dir")
        if state_dir is not None and (not isinstance(state_dir, str) or not state_dir):
            raise ConfigError(f"state_dir: expected a directory path, got {state_dir!r}")
        proc_root = top.get("proc_root", "/proc")
        if not isinstance(proc_root, str) or not proc_root:
            raise ConfigError(f"proc_root: expected a directory path, got {proc_root!r}")
        return DaemonConfig(
            proc_root=Path(proc_root),
            listen_host=host,
            listen_port=port,
            state_dir=Path(state_dir) if state_dir else default_state_dir(),
            log_level=log_level,
            disabled_collectors=check_collectors(collectors.get("disabled", []), "collectors.disabled"),
            kmsg=_kmsg(top.get("kmsg"), KmsgConfig()),
            processes=_processes(top.get("processes")),
            nvml=NvmlConfig(max_processes=_number(nvml.get("max_processes", 32), "nvml.max_processes",
                                                  integer=True, minimum=1)),
        )
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def load_file(path: str | Path) -> DaemonConfig:
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return from_mapping({} if data is None else data, str(path))


def from_args(args: Any) -> DaemonConfig:
    """Combine `--config FILE` (if any) with the flags; flags given on the command line win."""
    config = load_file(args.config) if args.config else from_mapping({})
    changes: dict[str, Any] = {}
    if args.listen is not None:
        changes["listen_host"], changes["listen_port"] = parse_listen(args.listen)
    if args.state_dir is not None:
        changes["state_dir"] = Path(args.state_dir)
    if args.proc_root is not None:
        changes["proc_root"] = Path(args.proc_root)
    if args.log_level is not None:
        changes["log_level"] = args.log_level
    if args.disable_collector:
        changes["disabled_collectors"] = tuple(
            dict.fromkeys(config.disabled_collectors + check_collectors(args.disable_collector, "--disable-collector"))
        )
    kmsg_changes: dict[str, Any] = {}
    if args.kmsg is not None:
        kmsg_changes["path"] = args.kmsg
    if args.burst_window is not None:
        kmsg_changes["burst_window_seconds"] = float(_number(args.burst_window, "--burst-window"))
    for i, spec in enumerate(args.kmsg_pattern or ()):
        name, sep, regex = spec.partition("=")
        if not sep:
            raise ConfigError(f"--kmsg-pattern {spec!r}: expected NAME=REGEX")
        existing = {p.name for p in config.kmsg.patterns} | {p.name for p in kmsg_changes.get("patterns", ())}
        if name in existing:
            raise ConfigError(f"--kmsg-pattern {spec!r}: pattern {name!r} is defined twice")
        pattern = UserPattern(_name(name, f"--kmsg-pattern {spec!r}"), _regex(regex, f"--kmsg-pattern {spec!r}"))
        kmsg_changes["patterns"] = kmsg_changes.get("patterns", config.kmsg.patterns) + (pattern,)
    if kmsg_changes:
        changes["kmsg"] = KmsgConfig(**{**config.kmsg.__dict__, **kmsg_changes})
    return DaemonConfig(**{**config.__dict__, **changes}) if changes else config
