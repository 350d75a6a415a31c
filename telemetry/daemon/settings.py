"""What a daemon runs with, as typed values: `DaemonConfig` and its sections.

config.py builds them from flags and a YAML file and checks every value; the collectors' `build(config)`,
the flight recorder and the protect loop read them. Nothing here knows which collectors exist: that is
the registry's (telemetry/daemon/registry.py), so the collectors can import this module and config.py
can import the collectors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from telemetry.daemon.kmsg.classify import UserPattern
from telemetry.daemon.patterns import Searcher
from telemetry.daemon.protect import ProtectConfig
from telemetry.paths import default_state_dir
from telemetry.scrape.ports import DAEMON_PORT


@dataclass(frozen=True)
class RolePattern:
    role: str
    cmdline: Searcher  # searched in the command line joined by spaces (user roles: RE2, linear time)


# vLLM's process titles: VLLM::APIServer_<n> (api server processes), VLLM::EngineCore[_DP<n>],
# VLLM::Worker[_TP<n>...]; a single API server keeps its original `vllm serve ...` command line.
DEFAULT_ROLES = (
    RolePattern("api_server",
                re.compile(r"^VLLM::APIServer|(?:^|[/\s])vllm\s+serve\b|vllm\.entrypoints\.openai\.api_server")),
    RolePattern("engine_core", re.compile(r"^VLLM::EngineCore")),
    RolePattern("worker", re.compile(r"^VLLM::Worker")),
)


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
    listen_port: int = DAEMON_PORT
    state_dir: Path = field(default_factory=default_state_dir)
    web_config: str | None = None  # the Prometheus exporter toolkit's web config file (TLS, basic auth)
    proc_root: Path = Path("/proc")  # the host's /proc when the daemon runs in a container (e.g. /host/proc)
    log_level: str = "info"
    disabled_collectors: tuple[str, ...] = ()  # the enabled ones: config.enabled_collectors(config)
    kmsg: KmsgConfig = KmsgConfig()
    processes: ProcessesConfig = ProcessesConfig()
    nvml: NvmlConfig = NvmlConfig()
    flight: FlightConfig = FlightConfig()
    # the evidence-gated last resort (telemetry/daemon/protect.py)
    protect: ProtectConfig = field(default_factory=ProtectConfig)
    state_dir_given: bool = False  # --state-dir, state_dir or $STATE_DIRECTORY: turns the flight recorder on

    @property
    def flight_enabled(self) -> bool:
        return self.state_dir_given if self.flight.enabled is None else self.flight.enabled


__all__ = ["DEFAULT_ROLES", "DaemonConfig", "FlightConfig", "KmsgConfig", "NvmlConfig", "ProcessesConfig",
           "RolePattern"]
