"""The `memtel daemon` subcommand: wire config, collectors, kernel-log follower and HTTP server.

Order matters: the config is checked and the port bound before anything starts, so a bad config
or a port in use exits non-zero with nothing half-started. SIGTERM and SIGINT stop it cleanly: the
server stops, the follower writes its state, exit status 0.
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

from prometheus_client import CollectorRegistry

from telemetry.daemon.collectors import NAMES as COLLECTOR_NAMES
from telemetry.daemon.config import DEFAULT_LISTEN, LOG_LEVELS, ConfigError, DaemonConfig, from_args
from telemetry.daemon.registry import Collector, DaemonCollectors

log = logging.getLogger("memtel.daemon")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config file (see configs/examples/daemon.yaml)")
    parser.add_argument(
        "--listen", metavar="HOST:PORT",
        help=f"where to serve /metrics and /healthz (default {DEFAULT_LISTEN}: next to node_exporter's 9100, "
             "clear of dcgm-exporter's 9400)",
    )
    parser.add_argument("--state-dir", metavar="DIR",
                        help="where the kernel-log state is kept (default: $STATE_DIRECTORY, /var/lib/memtel as "
                             "root, else ~/.local/state/memtel)")
    parser.add_argument("--proc-root", metavar="DIR",
                        help="where /proc is (default /proc; the host's /proc mounted in a container)")
    parser.add_argument("--kmsg", metavar="PATH", help="kernel log to follow (default /dev/kmsg; a file or FIFO works)")
    parser.add_argument("--kmsg-pattern", action="append", metavar="NAME=REGEX",
                        help="count kernel log lines matching REGEX as memtel_kernel_pattern_matches_total"
                             "{pattern=NAME} (repeatable)")
    parser.add_argument("--burst-window", type=float, metavar="SECONDS",
                        help="lines of one kind within this window count as one event (default 2)")
    parser.add_argument("--disable-collector", action="append", choices=COLLECTOR_NAMES, metavar="NAME",
                        help=f"turn a collector off (repeatable): {', '.join(COLLECTOR_NAMES)}")
    parser.add_argument("--log-level", choices=LOG_LEVELS)
    parser.add_argument("--check-config", action="store_true", help="check the configuration and exit")


def _error(message: str) -> None:
    print(f"memtel daemon: error: {message}", file=sys.stderr)


def _prepare_state_dir(path: Path) -> str | None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create the state directory {path}: {exc.strerror} (choose another with --state-dir DIR)"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"the state directory {path} is not writable (choose another with --state-dir DIR)"
    return None


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
                kmsg.path, Classifier(kmsg.patterns), KmsgCounts(kmsg.burst_window_seconds, kmsg.max_xid_codes),
                state_path=config.state_dir / STATE_FILE_NAME, boot_id=read_boot_id(str(config.proc_root / "sys/kernel/random/boot_id")),
            )
            collectors[name] = KmsgCollector(follower, tuple(p.name for p in kmsg.patterns))
    return collectors, follower


def run(args: argparse.Namespace) -> int:
    try:
        config = from_args(args)
    except ConfigError as exc:
        _error(str(exc))
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.check_config:
        print(f"memtel daemon: configuration OK (collectors: {', '.join(config.enabled_collectors)})")
        return 0

    from telemetry.daemon.server import ListenError, MetricsServer

    start_time = time.time()
    collectors, follower = build_collectors(config)
    wrapper = DaemonCollectors(collectors, start_time=start_time)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(wrapper)
    try:
        server = MetricsServer(config.listen_host, config.listen_port, registry, wrapper.health)
    except ListenError as exc:
        _error(str(exc))
        return 1
    if follower is not None:
        problem = _prepare_state_dir(config.state_dir)
        if problem is not None:
            server.stop()
            _error(problem)
            return 2

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
    server.start()
    log.info("memtel daemon listening on http://%s:%d/metrics (collectors: %s)",
             config.listen_host, server.port, ", ".join(collectors))
    while not stop.wait(3600):
        pass
    log.info("stopping (%s)", received[0] if received else "stop requested")
    server.stop()
    if follower is not None:
        follower.stop()
    log.info("stopped")
    return 0
