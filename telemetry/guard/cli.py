"""`memtel guard`: an OpenAI-compatible reverse proxy that refuses the prompt the engine could not take.

    memtel guard --upstream URL --listen HOST:PORT --hooks URL[,URL...] [--reserve-mb M] [--stale-s S]
                 [--when-blind admit|reject] [--metrics-listen HOST:PORT]

It reads the longest prefill that fits (memtel_forecast_max_prefill_tokens) from the ranks' hook
exporters, sizes every /v1/completions and /v1/chat/completions prompt, forwards what fits and answers
503 with Retry-After for what would not. docs/guard.md says how the limit is computed and how to deploy it.
SIGTERM or Ctrl-C stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal

from telemetry.argtypes import bounded_float
from telemetry.errors import ConfigError, RunError
from telemetry.exporter import MetricsServer, format_listen, parse_listen
from telemetry.exporter.metrics import ExporterCollector
from telemetry.guard.limit import HookTarget, LimitTracker, scrape_forever
from telemetry.guard.metrics import GuardMetrics, guard_registry
from telemetry.guard.proxy import WHEN_BLIND, GuardProxy, Upstream

log = logging.getLogger("memtel.guard")

DEFAULT_STALE_S = 15.0  # three of the hook's default 5 s forecast cycles
MAX_HOOKS = 64
MAX_RESERVE_MB = 16 << 20  # 16 TiB


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--upstream", required=True, help="the engine's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--listen", required=True, help="where clients connect: HOST:PORT, e.g. 0.0.0.0:8001")
    parser.add_argument("--hooks", required=True,
                        help="the ranks' hook exporters, comma-separated (both nodes of a TP=2 pair), e.g. "
                             "http://10.0.0.1:9200,http://10.0.0.2:9200")
    parser.add_argument("--reserve-mb", type=bounded_float(0, MAX_RESERVE_MB), default=0.0,
                        help="keep this much more of each rank's budget free (default 0: the hook's budget already "
                             "leaves MEMTEL_GUARD_RESERVE_MB)")
    parser.add_argument("--stale-s", type=bounded_float(0, 86400, above_minimum=True), default=DEFAULT_STALE_S,
                        help=f"a hook's forecast older than this is not used (default {DEFAULT_STALE_S:g})")
    parser.add_argument("--when-blind", choices=WHEN_BLIND, default="admit",
                        help="what to do with completion requests while no hook is fresh (default admit)")
    parser.add_argument("--metrics-listen", default=None,
                        help="serve the guard's own metrics on HOST:PORT /metrics (default: not served)")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def hook_targets(text: str) -> list[HookTarget]:
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise ConfigError(f"--hooks: {text[:80]!r}: expected one or more hook URLs separated by commas")
    if len(items) > MAX_HOOKS:
        raise ConfigError(f"--hooks: {len(items)} URLs; at most {MAX_HOOKS}")
    targets = [HookTarget.parse(item) for item in items]
    if len({t.url for t in targets}) != len(targets):
        raise ConfigError("--hooks: a hook URL is given twice")
    return targets


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    upstream = Upstream.parse(args.upstream)
    host, port = parse_listen(args.listen, "--listen")
    targets = hook_targets(args.hooks)
    metrics_address = parse_listen(args.metrics_listen, "--metrics-listen") if args.metrics_listen else None
    tracker = LimitTracker(targets, stale_s=args.stale_s, reserve_bytes=args.reserve_mb * (1 << 20))
    metrics = GuardMetrics()
    registry = guard_registry(metrics, tracker)
    proxy = GuardProxy(upstream, tracker, metrics, when_blind=args.when_blind)
    server = None
    if metrics_address is not None:
        server = MetricsServer(*metrics_address, registry, name="memtel-guard")  # binds now: fails first
        registry.register(ExporterCollector(server))
    try:
        return asyncio.run(_serve(proxy, tracker, host, port, server, args.stale_s))
    finally:
        if server is not None:
            server.stop()


async def _serve(proxy: GuardProxy, tracker: LimitTracker, host: str, port: int, server: MetricsServer | None,
                 stale_s: float) -> int:
    try:
        bound = await proxy.start(host, port)
    except OSError as exc:
        raise RunError(f"cannot listen on {format_listen(host, port)}: {exc.strerror or exc}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    poll_s = min(1.0, stale_s / 3)
    scraper = asyncio.create_task(scrape_forever(tracker, poll_s, timeout_s=max(0.2, min(5.0, stale_s / 2))))
    if server is not None:
        server.start()
    log.info("memtel guard on http://%s in front of %s, reading %d hook(s); metrics %s", format_listen(host, bound),
             proxy.upstream.url, len(tracker.hooks), server.url + "/metrics" if server else "not served")
    try:
        await stop.wait()
    finally:
        scraper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await scraper
        await proxy.stop()
    log.info("memtel guard stopped")
    return 0


__all__ = ["configure", "hook_targets", "run"]
