"""The `memtel daemon` subcommand: wire config, collectors, kernel-log follower and HTTP server.

Order matters: the config (and the web config, and --proc-root) is checked and the port bound
before anything starts, so a bad config or a port in use exits non-zero with nothing half-started;
then the state directory is made safe (`safefs.ensure_private_dir`: refused with exit 2 if another
user owns it or could replace it) and the temporaries of a killed save are removed. Every bad input
is one line on stderr and exit 2 (telemetry.errors.ConfigError), never a traceback. SIGTERM and
SIGINT stop it cleanly: the server stops, the follower writes its state, exit status 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

from prometheus_client import CollectorRegistry

from telemetry.daemon.collectors import NAMES as COLLECTOR_NAMES
from telemetry.daemon.config import DEFAULT_LISTEN, LOG_LEVELS, DaemonConfig, check_proc_root, from_args
from telemetry.daemon.registry import Collector, DaemonCollectors
from telemetry.errors import ConfigError

log = logging.getLogger("memtel.daemon")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config file (see configs/examples/daemon.yaml)")
    parser.add_argument(
        "--listen", metavar="HOST:PORT",
        help=f"where to serve /metrics and /healthz (default {DEFAULT_LISTEN}: every interface, next to "
             "node_exporter's 9100; 127.0.0.1:9101 keeps it on this machine; [::1]:9101 for IPv6)",
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
                        help="count kernel log lines matching REGEX as memtel_kernel_pattern_matches_total"
                             "{pattern=NAME} (repeatable)")
    parser.add_argument("--kmsg-count-test-lines", action="store_true",
                        help="also count kernel log lines of memtel's own test suite (they start with "
                             "'memtel-test:' and are ignored by default)")
    parser.add_argument("--burst-window", type=_finite_float, metavar="SECONDS",
                        help="lines of one kind within this window count as one event (default 2, at most 3600)")
    parser.add_argument("--disable-collector", action="append", choices=COLLECTOR_NAMES, metavar="NAME",
                        help=f"turn a collector off (repeatable): {', '.join(COLLECTOR_NAMES)}")
    parser.add_argument("--no-flight-recorder", action="store_true",
                        help="do not keep the flight recorder's ring in STATE_DIR/flight (it is on when a state "
                             "directory is given; docs/flight-recorder.md)")
    parser.add_argument("--flight-duration", metavar="DURATION",
                        help="how much the flight recorder's ring holds (default 15m; e.g. 900, 90s, 30m, 2h)")
    parser.add_argument("--log-level", choices=LOG_LEVELS)
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
    from telemetry.safefs import UnsafePathError, ensure_private_dir, remove_stale_temporaries

    try:
        ensure_private_dir(path, what="state directory")
    except UnsafePathError as exc:
        raise ConfigError(f"{exc} (choose another with --state-dir DIR)") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"the state directory {path} is not writable (choose another with --state-dir DIR)")
    removed = remove_stale_temporaries(path / STATE_FILE_NAME)
    if removed:
        log.info("removed %d temporary state file(s) left by an interrupted save in %s", removed, path)


def build_collectors(config: DaemonConfig):
    """(collectors by name, kmsg follower or None). Nothing is started here."""
    from telemetry.daemon.kmsg.classify import Classifier
    from telemetry.daemon.kmsg.counts import KmsgCounts
    from telemetry.daemon.kmsg.follower import KmsgFollower
    from telemetry.daemon.kmsg.state import STATE_FILE_NAME, read_boot_id

    collectors: dict[str, Collector] = {}
    follower = None
    for name in config.enabled_collectors:
        if name == "meminfo":
            from telemetry.daemon.collectors.meminfo import MeminfoCollector

            collectors[name] = MeminfoCollector(str(config.proc_root / "meminfo"))
        elif name == "vmstat":
            from telemetry.daemon.collectors.vmstat import VmstatCollector

            collectors[name] = VmstatCollector(str(config.proc_root / "vmstat"))
        elif name == "pressure":
            from telemetry.daemon.collectors.pressure import PressureCollector

            collectors[name] = PressureCollector(str(config.proc_root / "pressure" / "memory"))
        elif name == "buddyinfo":
            from telemetry.daemon.collectors.buddyinfo import BuddyinfoCollector

            collectors[name] = BuddyinfoCollector(str(config.proc_root / "buddyinfo"))
        elif name == "headroom":
            from telemetry.daemon.collectors.headroom import HeadroomCollector

            collectors[name] = HeadroomCollector(str(config.proc_root / "meminfo"), str(config.proc_root / "buddyinfo"))
        elif name == "nvml":
            from telemetry.daemon.collectors.nvml import NvmlCollector

            collectors[name] = NvmlCollector(max_processes=config.nvml.max_processes)
        elif name == "processes":
            import psutil

            from telemetry.daemon.collectors.processes import ProcessCollector

            psutil.PROCFS_PATH = str(config.proc_root)  # psutil reads processes from one global /proc path

            collectors[name] = ProcessCollector(
                config.processes.roles, max_per_role=config.processes.max_per_role,
                recheck_seconds=config.processes.recheck_seconds,
            )
        elif name == "kmsg":
            from telemetry.daemon.collectors.kmsg import KmsgCollector

            kmsg = config.kmsg
            follower = KmsgFollower(
                kmsg.path, Classifier(kmsg.patterns, ignore_test_lines=kmsg.ignore_test_lines),
                KmsgCounts(kmsg.burst_window_seconds, kmsg.max_xid_codes),
                state_path=config.state_dir / STATE_FILE_NAME,
                boot_id=read_boot_id(str(config.proc_root / "sys/kernel/random/boot_id")),
            )
            collectors[name] = KmsgCollector(follower, tuple(p.name for p in kmsg.patterns))
    return collectors, follower


def run(args: argparse.Namespace) -> int:
    from telemetry.exporter import load_web_config

    config = from_args(args)  # ConfigError: one line and exit 2 (telemetry.cli)
    logging.basicConfig(
        level=config.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    check_proc_root(config.proc_root)
    web_config = load_web_config(config.web_config)
    if args.check_config:
        print(f"memtel daemon: configuration OK (collectors: {', '.join(config.enabled_collectors)}; "
              f"{web_config.describe()})")
        return 0

    from prometheus_client import ProcessCollector

    from telemetry.exporter import MetricsServer, format_listen
    from telemetry.exporter.metrics import ExporterCollector

    start_time = time.time()
    collectors, follower = build_collectors(config)
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
    if follower is not None or flight is not None:
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

    if follower is not None:
        follower.load_state()
        follower.start()
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
    if follower is not None:
        follower.stop()
    log.info("stopped")
    return 0
