"""`memtel guard`: an OpenAI-compatible reverse proxy that refuses the prompt the engine could not take.

    memtel guard --upstream URL --listen HOST:PORT --hooks URL[,URL...] [--reserve-mb M] [--stale-s S]
                 [--when-blind admit|reject] [--metrics-listen HOST:PORT] [--queue-s S] [--max-queued N]
    memtel guard --replica URL=HOOK[,HOOK...] --replica ... | --replicas FILE.yaml  --listen HOST:PORT ...

It reads the longest prefill that fits (memtel_forecast_max_prefill_tokens) from the ranks' hook
exporters, sizes every /v1/completions, /v1/chat/completions and /v1/responses prompt, forwards what fits (to
the replica with the most room, given several), holds what does not fit now for up to --queue-s (30 s by
default), and answers 503 with Retry-After for what still would not. docs/guard.md says how the limit is
computed and how to deploy it.
SIGTERM or Ctrl-C stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from telemetry import hook_env
from telemetry.admission.core import SETTING_RANGES
from telemetry.argtypes import add_log_level, bounded_float, bounded_int
from telemetry.errors import INTERRUPTED, printable
from telemetry.exporter import MetricsServer, format_listen, listen_failed, parse_listen
from telemetry.exporter.metrics import ExporterCollector
from telemetry.guard.bounds import DEFAULT_QUEUE_S
from telemetry.guard.limit import LimitTracker, scrape_forever
from telemetry.guard.metrics import GuardMetrics, guard_registry
from telemetry.guard.proxy import WHEN_BLIND, GuardLimits, GuardProxy
from telemetry.guard.replicas import MAX_HOOKS, engines, hook_targets

log = logging.getLogger("memtel.guard")

DEFAULT_STALE_S = 15.0  # three of the hook's default 5 s forecast cycles
MIN_STALE_S, MAX_STALE_S = SETTING_RANGES["stale_s"]  # the ranges of every front door (the admission core)
MAX_RESERVE_MB = SETTING_RANGES["reserve_mb"][1]
MAX_QUEUE_S = SETTING_RANGES["queue_s"][1]
MAX_QUEUED = int(SETTING_RANGES["max_queued"][1])


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--upstream", default=None, metavar="URL", help="the engine's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--listen", required=True, metavar="HOST:PORT",
                        help="where clients connect, e.g. 0.0.0.0:8001")
    parser.add_argument("--hooks", default=None, metavar="URL[,URL...]",
                        help="the ranks' hook exporters, comma-separated (both nodes of a TP=2 pair), e.g. "
                             "http://10.0.0.1:9200,http://10.0.0.2:9200")
    parser.add_argument("--replica", action="append", default=None, metavar="URL=HOOK[,HOOK...]",
                        help="one engine of several and its ranks' hooks (repeat it; instead of --upstream/--hooks): "
                             "each prompt goes to the replica with the most room")
    parser.add_argument("--replicas", default=None, metavar="FILE.yaml",
                        help="the replicas in a YAML file: replicas: [{upstream: URL, hooks: [URL, ...]}, ...]")
    parser.add_argument("--queue-s", type=bounded_float(0, MAX_QUEUE_S), default=DEFAULT_QUEUE_S,
                        help="how long a prompt that does not fit now waits in the guard's queue for room before "
                             f"its 503 (default {DEFAULT_QUEUE_S:g}; 0: 503 at once)")
    parser.add_argument("--max-queued", type=bounded_int(1, MAX_QUEUED), default=GuardLimits.max_queued,
                        help=f"requests waiting at most; past it, 503 at once (default {GuardLimits.max_queued}; "
                             "each holds its body, up to 64 MiB)")
    parser.add_argument("--reserve-mb", type=bounded_float(0, MAX_RESERVE_MB), default=0.0,
                        help="keep this much more of each rank's budget free (default 0: the hook's budget already "
                             f"leaves {hook_env.GUARD_RESERVE_MB})")
    parser.add_argument("--stale-s", type=bounded_float(MIN_STALE_S, MAX_STALE_S), default=DEFAULT_STALE_S,
                        help=f"a hook's forecast older than this is not used (default {DEFAULT_STALE_S:g}; "
                             f"{MIN_STALE_S:g} to {MAX_STALE_S:g})")
    parser.add_argument("--when-blind", choices=WHEN_BLIND, default="admit",
                        help="what to do with completion requests while no hook is fresh (default admit)")
    parser.add_argument("--metrics-listen", default=None, metavar="HOST:PORT",
                        help="serve the guard's own metrics on HOST:PORT /metrics (default: not served)")
    add_log_level(parser)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    specs = engines(args.upstream, args.hooks, args.replica, args.replicas)
    host, port = parse_listen(args.listen, "--listen")
    metrics_address = parse_listen(args.metrics_listen, "--metrics-listen") if args.metrics_listen else None
    replicas = [(upstream, LimitTracker(targets, stale_s=args.stale_s, reserve_bytes=args.reserve_mb * (1 << 20)))
                for upstream, targets in specs]
    metrics = GuardMetrics()
    limits = GuardLimits(queue_s=args.queue_s, max_queued=args.max_queued)
    proxy = GuardProxy(*replicas[0], metrics, when_blind=args.when_blind, limits=limits, replicas=replicas)
    registry = guard_registry(metrics, proxy.tracker, proxy.replicas)
    server = None
    if metrics_address is not None:
        server = MetricsServer(*metrics_address, registry, name="memtel-guard")  # binds now: fails first
        registry.register(ExporterCollector(server))
    try:
        return asyncio.run(_serve(proxy, host, port, server, args.stale_s))
    finally:
        if server is not None:
            server.stop()


async def _serve(proxy: GuardProxy, host: str, port: int, server: MetricsServer | None, stale_s: float) -> int:
    try:
        bound = await proxy.start(host, port)
    except OSError as exc:
        raise listen_failed(host, port, exc) from None
    stop = asyncio.Event()
    received: list[signal.Signals] = []
    loop = asyncio.get_running_loop()

    def stop_on(signum: signal.Signals) -> None:
        received.append(signum)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop_on, signum)
    poll_s = min(1.0, stale_s / 3)
    timeout_s = max(0.2, min(5.0, stale_s / 2))
    tasks = [asyncio.create_task(scrape_forever(r.tracker, poll_s, timeout_s)) for r in proxy.replicas]
    if len(proxy.replicas) > 1:  # one replica never leaves the pool: its failures reach the client as today
        tasks.append(asyncio.create_task(proxy.watch_health(poll_s, timeout_s)))
    if server is not None:
        server.start()
    log.info("memtel guard on http://%s in front of %s, reading %d hook(s); metrics %s", format_listen(host, bound),
             ", ".join(r.name for r in proxy.replicas), sum(len(r.tracker.hooks) for r in proxy.replicas),
             server.url + "/metrics" if server else "not served")
    stopped = asyncio.create_task(stop.wait())
    try:
        # The scrapes and the health polls go on by themselves (supervised); one that ends all the same would
        # leave the guard deciding on readings nobody updates: the guard exits 1 instead, said in one line.
        await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in [stopped, *tasks]:
            task.cancel()
        ended = await asyncio.gather(*tasks, return_exceptions=True)
        await proxy.stop()
    if not stop.is_set():
        why = next((repr(e) for e in ended if isinstance(e, Exception)), "ended")
        log.error("memtel guard: a background task (hook scrapes, health polls) stopped: %s; exiting",
                  printable(why, 200))
        return 1
    log.info("memtel guard stopped")
    return INTERRUPTED if received[:1] == [signal.SIGINT] else 0  # Ctrl-C: 130 as every command; SIGTERM: 0


__all__ = ["MAX_HOOKS", "configure", "hook_targets", "run"]
