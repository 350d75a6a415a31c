"""The `memtel daemon` subcommand: wire config, collectors, kernel-log follower, protect loop and HTTP server.

Order matters: the config (and the web config, and --proc-root) is checked and the port bound
before anything starts, so a bad config or a port in use exits non-zero with nothing half-started;
then the state directory is made safe (`safefs.ensure_private_dir`: refused with exit 2 if another
user owns it or could replace it) and the temporaries of a killed save are removed. Every bad input
is one line on stderr and exit 2 (telemetry.errors.ConfigError), never a traceback. SIGTERM and
SIGINT stop it cleanly: the server stops, the follower writes its state, exit status 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from prometheus_client import CollectorRegistry

from telemetry.argtypes import add_log_level
from telemetry.catalogue.metrics import KERNEL_PATTERN
from telemetry.daemon.collectors import BY_NAME as COLLECTORS
from telemetry.daemon.collectors import NAMES as COLLECTOR_NAMES
from telemetry.daemon.config import (
    DEFAULT_LISTEN,
    check_collectors,
    check_proc_root,
    enabled_collectors,
    from_args,
)
from telemetry.daemon.registry import BackgroundCollector, Collector, DaemonCollectors
from telemetry.daemon.settings import DaemonConfig
from telemetry.errors import INTERRUPTED, ConfigError
from telemetry.scrape.ports import DAEMON_PORT

if TYPE_CHECKING:
    from telemetry.daemon.protect import Protect

log = logging.getLogger("memtel.daemon")
protect_log = logging.getLogger("memtel.daemon.protect")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config file (see configs/examples/daemon.yaml)")
    parser.add_argument(
        "--listen", metavar="HOST:PORT",
        help=f"where to serve /metrics and /healthz (default {DEFAULT_LISTEN}: every interface, next to "
             f"node_exporter's 9100; 127.0.0.1:{DAEMON_PORT} keeps it on this machine; [::1]:{DAEMON_PORT} for IPv6)",
    )
    parser.add_argument("--web-config", metavar="FILE",
                        help="TLS and basic auth, in the Prometheus exporter toolkit's web config format "
                             "(node_exporter's --web.config.file; see docs/metrics.md)")
    parser.add_argument("--state-dir", metavar="DIR",
                        help="where the kernel-log state is kept (default: $STATE_DIRECTORY, /var/lib/memtel as "
                             "root, else ~/.local/state/memtel)")
    parser.add_argument("--proc-root", metavar="DIR",
                        help="where /proc is (default /proc; the host's /proc mounted in a container)")
    parser.add_argument("--kmsg", metavar="PATH", help="kernel log to follow (default /dev/kmsg; a file or FIFO works)")
    parser.add_argument("--kmsg-pattern", action="append", metavar="NAME=REGEX",
                        help=f"count kernel log lines matching REGEX as {KERNEL_PATTERN[0].series}"
                             "{pattern=NAME} (repeatable)")
    parser.add_argument("--kmsg-count-test-lines", action="store_true",
                        help="also count kernel log lines of memtel's own test suite (they start with "
                             "'memtel-test:' and are ignored by default)")
    parser.add_argument("--burst-window", type=_finite_float, metavar="SECONDS",
                        help="lines of one kind within this window count as one event (default 2, at most 3600)")
    parser.add_argument("--disable-collector", action="append", choices=COLLECTOR_NAMES, metavar="NAME",
                        help=f"turn a collector off (repeatable): {', '.join(COLLECTOR_NAMES)}")
    parser.add_argument("--enable-collector", action="append", choices=COLLECTOR_NAMES, metavar="NAME",
                        help="turn a collector on that the config file's collectors.disabled turns off (repeatable)")
    parser.add_argument("--no-flight-recorder", action="store_true",
                        help="do not keep the flight recorder's ring in STATE_DIR/flight (it is on when a state "
                             "directory is given; docs/flight-recorder.md)")
    parser.add_argument("--flight-duration", metavar="DURATION",
                        help="how much the flight recorder's ring holds (default 15m; e.g. 900, 90s, 30m, 2h)")
    add_log_level(parser, default=None)   # None: the config file's, else its default
    parser.add_argument("--check-config", action="store_true",
                        help="check the configuration (and web config, patterns, --proc-root) and exit")
    # argparse would print its usage block too; a bad flag is one line like every other bad input.
    parser.error = lambda message: _usage_error(parser, message)  # type: ignore[method-assign]


def _finite_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _usage_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    print(f"{parser.prog}: error: {message} (see {parser.prog} --help)", file=sys.stderr)
    sys.exit(2)


def _prepare_state_dir(path: Path) -> None:
    """A private state directory with no temporaries of a killed save left in it; ConfigError otherwise."""
    from telemetry.daemon.kmsg.state import STATE_FILE_NAME
    from telemetry.daemon.statelock import hold_state_dir
    from telemetry.safefs import UnsafePathError, ensure_private_dir, remove_stale_temporaries

    try:
        ensure_private_dir(path, what="state directory")
    except UnsafePathError as exc:
        raise ConfigError(f"{exc} (choose another with --state-dir DIR)") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"the state directory {path} is not writable (choose another with --state-dir DIR)")
    hold_state_dir(path)  # one daemon per state directory: a second one refuses, naming the first's pid
    removed = remove_stale_temporaries(path / STATE_FILE_NAME)
    if removed:
        log.info("removed %d temporary state file(s) left by an interrupted save in %s", removed, path)


def build_collectors(config: DaemonConfig) -> dict[str, Collector]:
    """The enabled collectors by name, in scrape order, built by their registrations. Nothing is started here."""
    return {name: COLLECTORS[name].build(config) for name in enabled_collectors(config)}


def build_protect(config: DaemonConfig) -> Protect:
    """The protect loop of a daemon config (telemetry/daemon/protect.py): it reads the headroom with the headroom's
    definition (telemetry.procfs.headroom.HeadroomReader, the reading the headroom collector exports), MemTotal
    from meminfo, the engines' starts from the local hook exporters of `flight.hook_targets` (none configured: no
    start explains a fall), and the roles of the process collector."""
    from telemetry.daemon.protect import Protect, Reading, start_remaining_bytes
    from telemetry.flight.hooks import HookScraper
    from telemetry.procfs.headroom import HeadroomReader
    from telemetry.procfs.meminfo import MeminfoReader
    from telemetry.url import redact_credentials

    root = config.proc_root
    headroom = HeadroomReader(str(root / "meminfo"), str(root / "buddyinfo"), vmstat_path=str(root / "vmstat"))
    meminfo = MeminfoReader(str(root / "meminfo"))
    targets = config.flight.hook_targets
    starts = HookScraper(targets, config.protect.interval_seconds) if targets else None

    def sample() -> Reading | None:
        reading = headroom.read()
        total = meminfo.read().get("MemTotal")
        if not total:
            return None
        return Reading(float(reading.headroom), float(total),
                       {} if starts is None else start_remaining_bytes(starts.latest(), total),
                       float(reading.without_reclaim), reading.success_ratio)

    roles = {role.role: role.cmdline for role in config.processes.roles}
    protect = Protect(config.protect, sample, roles)
    protect.starts = starts
    mode = "dry run, " if config.protect.dry_run else ""
    protect_log.info("protect on (%swill %s once per falling-headroom episode; engine starts read from %s)", mode,
             config.protect.describe_action(),
             ", ".join(map(redact_credentials, targets)) if targets else "no hook exporter")
    return protect


def _enable(config: DaemonConfig, args: argparse.Namespace) -> DaemonConfig:
    """--enable-collector: turn collectors back on that the config file's collectors.disabled turns off."""
    names = getattr(args, "enable_collector", None)
    if not names:
        return config
    enabled = check_collectors(names, "--enable-collector")
    both = sorted(set(enabled) & set(args.disable_collector or ()))
    if both:
        raise ConfigError(f"--enable-collector and --disable-collector both name {', '.join(both)}; give one")
    return dataclasses.replace(config, disabled_collectors=tuple(
        name for name in config.disabled_collectors if name not in enabled))


def run(args: argparse.Namespace) -> int:
    from telemetry.exporter import load_web_config

    config = _enable(from_args(args), args)  # ConfigError: one line and exit 2 (telemetry.cli)
    logging.basicConfig(
        level=config.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    check_proc_root(config.proc_root)
    web_config = load_web_config(config.web_config)
    if args.check_config:
        print(f"memtel daemon: configuration OK (collectors: {', '.join(enabled_collectors(config))}; "
              f"{web_config.describe()})")
        return 0

    from prometheus_client import ProcessCollector

    from telemetry.exporter import MetricsServer, format_listen
    from telemetry.exporter.metrics import ExporterCollector

    start_time = time.time()
    collectors = build_collectors(config)
    if config.protect.enabled:
        collectors["protect"] = build_protect(config)  # started and stopped below, like the kernel log's follower
    background = [c for c in collectors.values() if isinstance(c, BackgroundCollector)]  # the kernel log's
    flight = None
    if config.flight_enabled:
        from telemetry.daemon.flight import COLLECTOR_NAME, DaemonFlight

        flight = DaemonFlight(config)
        collectors[COLLECTOR_NAME] = flight.recorder
    wrapper = DaemonCollectors(collectors, start_time=start_time)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(wrapper)
    ProcessCollector(registry=registry)  # process_* self-metrics: the unit caps the daemon at MemoryMax=256M
    server = MetricsServer(config.listen_host, config.listen_port, registry, health=wrapper.health,
                           web_config=web_config, name="memtel daemon")  # ListenError: exit 1
    registry.register(ExporterCollector(server))
    if flight is not None or any(COLLECTORS[name].uses_state_dir for name in enabled_collectors(config)):
        try:
            _prepare_state_dir(config.state_dir)
        except ConfigError:
            server.stop()
            raise

    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    for collector in background:
        collector.start()
    if flight is not None:
        flight.start(wrapper)
    server.start()
    log.info("memtel daemon listening on %s (/metrics, /healthz; %s; collectors: %s)",
             format_listen(config.listen_host, server.port), web_config.describe(), ", ".join(collectors))
    if config.listen_host in ("0.0.0.0", "::"):
        log.info("listening on every interface: restrict with --listen 127.0.0.1:%d or a firewall, or protect it "
                 "with --web-config (TLS, basic auth); see docs/metrics.md", server.port)
    while not stop.wait(3600):
        pass
    log.info("stopping (%s)", received[0] if received else "stop requested")
    server.stop()
    if flight is not None:
        flight.stop()
    for collector in background:
        collector.stop()
    log.info("stopped")
    return INTERRUPTED if received[:1] == ["SIGINT"] else 0  # Ctrl-C: 130 as every command; SIGTERM: a clean stop
