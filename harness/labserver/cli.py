"""`memtel lab serve`: the lab model behind an OpenAI-compatible API, with the sparse indexer's allocations.

    memtel lab serve --arm stock|fixed [--ranks N] [--allocator cuda|sim] [--layers L] [--chunk C]
                     [--max-model-len T] [--compress-ratio R] [--budget-mb B] [--listen HOST:PORT]
                     [--hook-listen HOST:PORT] [--scale S] [--time-scale X]
                     [--capacity-gb X [--tenant GIB@START_S+DURATION_S]]

It answers like a vLLM server (so `memtel ab` and any OpenAI client can drive it) and runs, per
request, the indexer's logits launches of a chunked prefill on N rank processes, each with memtel's
hook on the `lab-indexer` preset (exporter on MEMTEL_PORT + rank, JSONL log in MEMTEL_LOG_DIR).
SIGTERM or Ctrl-C stops the ranks and the server.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading

from harness.labserver.engine import DEFAULT_SIM_SCALE, DEFAULT_SIM_TIME_SCALE, LabConfig
from harness.labserver.tenant import TENANT_FORMAT, parse_tenant
from telemetry import hook_env, limits
from telemetry.argtypes import add_log_level, bounded_float, bounded_int, fraction, port
from telemetry.errors import INTERRUPTED, ConfigError, RunError
from telemetry.exporter import listen_failed, parse_listen
from telemetry.model.indexer.backends import ALLOCATORS, default_allocator
from telemetry.model.indexer.planner import MODES
from telemetry.model.indexer.shape import add_shape_arguments, shape_from_args
from telemetry.scrape import HOOK_PORT, LAB_PORT

log = logging.getLogger("memtel.lab")


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="lab_command", metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve the lab model (OpenAI-compatible) with the indexer's allocations",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(serve)


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    defaults = LabConfig()
    # The flag is --arm for compatibility; what it takes is a width mode.
    serve.add_argument("--arm", dest="mode", required=True, choices=MODES,
                       help="the width mode: stock: logits as wide as the kv so far; fixed: one padded width "
                            "from the first chunk")
    serve.add_argument("--ranks", type=bounded_int(1, limits.MAX_LAB_RANKS), default=defaults.ranks,
                       help=f"rank processes, one GPU each when there are GPUs (default {defaults.ranks})")
    serve.add_argument("--allocator", choices=ALLOCATORS, default=None,
                       help="cuda: real CUDA allocations; sim: the caching-allocator simulator with host-backed "
                            "segments (default: cuda when a GPU is available, else sim)")
    add_shape_arguments(serve)
    serve.add_argument("--scale", type=fraction, default=None,
                       help=f"multiply the rows (so the bytes) of every logits launch by S, so the unified-memory "
                            f"emulation fits this machine (default {DEFAULT_SIM_SCALE} with sim, 1 with cuda)")
    serve.add_argument("--time-scale", type=bounded_float(0, limits.MAX_TIME_SCALE), default=DEFAULT_SIM_TIME_SCALE,
                       help=f"multiply the cost model's times by X (default {DEFAULT_SIM_TIME_SCALE}): the prefill "
                            f"on sim (calibrated to a 54 s cold 100k-token prefill; cuda prefills take real time) and "
                            f"each output token (50 ms) on both")
    serve.add_argument("--alloc-conf", default=None,
                       help="sim: allocator settings in PYTORCH_CUDA_ALLOC_CONF syntax (default: that variable)")
    serve.add_argument("--capacity-gb", type=bounded_float(0, limits.MAX_CAPACITY_GIB, above_minimum=True),
                       default=None,
                       help="sim: the node's unified memory, in GiB, shared by every rank: a launch beyond it runs "
                            "out of memory as on the device (the request fails and the engine dies, as vLLM's), and "
                            "the hook's fit budget is what it has left (default: unlimited)")
    serve.add_argument("--tenant", type=parse_tenant, default=None, metavar=TENANT_FORMAT,
                       help="with --capacity-gb: another process (a second engine, a job) takes GIB of the node's "
                            "memory START_S seconds after the ranks are up and gives it back DURATION_S later, as on a "
                            "DGX Spark; while the server runs, POST /lab/tenant {\"gib\": G, \"seconds\": S} does "
                            "the same at once")
    serve.add_argument("--no-unified-memory", action="store_true",
                       help="sim: do not back simulated segments with host memory")
    serve.add_argument("--no-hook", action="store_true", help="do not install memtel's hook in the ranks")
    serve.add_argument("--hook-listen", default=None, metavar="HOST:PORT",
                       help=f"where the ranks' hook exporters listen: on HOST, rank r on PORT + r (default: "
                            f"--listen's host, port ${hook_env.PORT} or {HOOK_PORT})")
    serve.add_argument("--memtel-port", type=port, default=None, metavar="PORT", help=argparse.SUPPRESS)  # before
    serve.add_argument("--memtel-log-dir", default=None,
                       help=f"directory for the hook's per-call JSONL logs (default: ${hook_env.LOG_DIR}, else none)")
    serve.add_argument("--model-name", default=None, help="model name served (default lab-<mode>)")
    serve.add_argument("--listen", default=None, metavar="HOST:PORT",
                       help=f"the address to serve on (default {DEFAULT_LISTEN}, loopback)")
    # The spellings before --listen, kept working for scripts and ladders that use them; not shown.
    serve.add_argument("--host", default=None, metavar="HOST", help=argparse.SUPPRESS)
    serve.add_argument("--port", type=port, default=None, metavar="PORT", help=argparse.SUPPRESS)
    add_log_level(serve)


DEFAULT_LISTEN = f"127.0.0.1:{LAB_PORT}"


def listen_address(args: argparse.Namespace) -> tuple[str, int]:
    """`--listen HOST:PORT` (or the hidden `--host` / `--port` it replaces) as (host, port)."""
    if args.listen is not None:
        if args.host is not None or args.port is not None:
            raise ConfigError("--listen HOST:PORT says both: give it without --host and --port")
        return parse_listen(args.listen, "--listen")
    return (args.host if args.host is not None else "127.0.0.1", args.port if args.port is not None else LAB_PORT)


def config_from_args(args: argparse.Namespace) -> LabConfig:
    allocator = args.allocator or default_allocator()
    if args.capacity_gb is not None and allocator != "sim":
        raise ConfigError(f"--capacity-gb {args.capacity_gb:g} emulates a node's memory on the sim allocator; "
                          f"with --allocator {allocator} the device's own memory applies (use --allocator sim)")
    if args.tenant is not None and (args.capacity_gb is None or args.tenant.nbytes > args.capacity_gb * (1 << 30)):
        raise ConfigError(f"--tenant takes part of the node's emulated memory: it needs --capacity-gb of at least its "
                          f"{args.tenant.nbytes / (1 << 30):g} GiB")
    scale = args.scale if args.scale is not None else (DEFAULT_SIM_SCALE if allocator == "sim" else 1.0)
    memtel_addr, memtel_port = listen_address(args)[0], args.memtel_port
    if args.hook_listen is not None:
        if memtel_port is not None:
            raise ConfigError("--hook-listen HOST:PORT says the port: give it without --memtel-port")
        memtel_addr, memtel_port = parse_listen(args.hook_listen, "--hook-listen")
        if memtel_port == 0:
            raise ConfigError("--hook-listen: port 0 picks no port here; expected PORT in 1..65535 (rank r listens "
                              "on PORT + r)")
    if memtel_port is None:
        env_port = os.environ.get(hook_env.PORT, "").strip()
        valid = env_port.isascii() and env_port.isdigit() and len(env_port) <= 5 and 1 <= int(env_port) <= 65535
        if env_port and not valid:
            raise ConfigError(f"{hook_env.PORT}={env_port[:20]!r}: expected a port number in 1..65535 (ASCII digits)")
        memtel_port = int(env_port) if env_port else HOOK_PORT
    if not args.no_hook and memtel_port + args.ranks - 1 > 65535:
        raise ConfigError(f"the hook exporters listen on {memtel_port} + rank: {memtel_port} + {args.ranks - 1} "
                          "is past 65535; choose a lower port in --hook-listen")
    return LabConfig(
        mode=args.mode, ranks=args.ranks, allocator=allocator, shape=shape_from_args(args), scale=scale,
        time_scale=args.time_scale,
        alloc_conf=args.alloc_conf if args.alloc_conf is not None else os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        unified_memory=not args.no_unified_memory, memtel_port=memtel_port,
        memtel_log_dir=args.memtel_log_dir or os.environ.get(hook_env.LOG_DIR) or None, hook=not args.no_hook,
        memtel_addr=memtel_addr,
        capacity_bytes=None if args.capacity_gb is None else int(args.capacity_gb * (1 << 30)), tenant=args.tenant,
    )


def run(args: argparse.Namespace) -> int:
    if getattr(args, "lab_command", None) != "serve":
        raise ConfigError("usage: memtel lab serve --arm stock|fixed [options]  (see `memtel lab serve --help`)")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    host, listen_port = listen_address(args)
    config = config_from_args(args)
    return serve(config, host=host, port=listen_port, model_name=args.model_name or f"lab-{config.mode}")


def serve(config: LabConfig, host: str, port: int, model_name: str) -> int:
    from harness.labserver.engine import EngineError, LabEngine
    from harness.labserver.server import LabService, make_server

    engine = LabEngine(config)
    service = LabService(engine, model_name, config.shape.max_model_len)
    try:
        httpd = make_server(service, host, port)  # bind first: a port in use fails before any rank starts
    except socket.gaierror as exc:  # a host name that does not resolve, an address that is not one
        raise ConfigError(f"--listen {host!r}: not an address of this machine ({exc.strerror or exc})") from None
    except OSError as exc:
        raise listen_failed(host, port, exc) from None
    stopping = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: shutting down", signum)
        received.append(signum)
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # /health answers 503 while the ranks start, so a client polling it sees progress, not a hang.
    http_thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                   name="memtel-lab-http", daemon=True)
    http_thread.start()
    status = 0
    try:
        try:
            engine.start()
        except EngineError as exc:
            raise RunError(f"the ranks did not start: {exc}") from None
        log.info("memtel lab serving %s on http://%s:%d (mode %s, %d rank(s), allocator %s, scale %g)",
                 model_name, host, port, config.mode, config.ranks, config.allocator, config.scale)
        while not stopping.wait(0.5):
            if not engine.healthy():
                log.error("stopping: %s", engine.problem())
                status = 1
                stopping.wait(1.0)   # the failed request's answer is on its way, as vLLM answers before it stops
                break
    finally:
        httpd.shutdown()
        httpd.server_close()
        engine.stop()
    if status == 0 and received[:1] == [signal.SIGINT]:
        return INTERRUPTED  # Ctrl-C: 130 as every command (SIGTERM is a clean stop: 0)
    return status
