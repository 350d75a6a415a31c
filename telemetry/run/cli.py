"""`memtel run [--targets SPEC] [--listen HOST:PORT] [--log-dir D] [--unresolved-after S] [--] COMMAND...`

Runs COMMAND with the hook in it and in every Python process it starts, the way opentelemetry-instrument
and ddtrace-run do it: the bootstrap directory (telemetry/run/bootstrap, a `sitecustomize.py`) goes
first on PYTHONPATH, the hook's settings into MEMTEL_* variables, and memtel execs the command
(`os.execvpe`): the program keeps memtel's pid, its signals and its exit status are its own.

Everything is checked before the exec (the targets and presets, the port, the log directory, every
MEMTEL_* variable already set): bad input is one line and exit 2, and nothing has started. A command
that cannot be found exits 127, one that cannot be executed 126, as with env(1).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from telemetry import hook_env
from telemetry.errors import ConfigError, RunError
from telemetry.scrape.ports import HOOK_PORT

BOOTSTRAP_DIR = str(Path(__file__).resolve().parent / "bootstrap")
USAGE = ("memtel run [--targets SPEC] [--listen HOST:PORT] [--log-dir D] [--unresolved-after S] [--] "
         "COMMAND [ARGS...]")


class CommandNotFound(RunError):
    exit_code = 127


class CommandNotExecutable(RunError):
    exit_code = 126


def configure(parser: argparse.ArgumentParser) -> None:
    parser.usage = USAGE
    parser.add_argument("--targets", metavar="SPEC",
                        help='comma-separated "package.module:function", "package.module:Class.method" or presets '
                             f"(vllm-sparse-indexer, sglang-sparse-indexer, ...); default: {hook_env.TARGETS}")
    parser.add_argument("--listen", metavar="HOST:PORT",
                        help='where the exporters listen: on HOST, each process on PORT + its rank; "off": no '
                             f"exporter; default: {hook_env.ADDR}:{hook_env.PORT}, else 0.0.0.0:{HOOK_PORT} (every "
                             f"interface; 127.0.0.1:{HOOK_PORT} keeps them on this machine)")
    # The spellings before --listen (MEMTEL_PORT's and MEMTEL_ADDR's values), kept working; not shown.
    parser.add_argument("--port", metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--addr", metavar="HOST", help=argparse.SUPPRESS)
    parser.add_argument("--log-dir", metavar="D",
                        help=f"directory of the per-call JSONL logs; default: {hook_env.LOG_DIR}")
    parser.add_argument("--unresolved-after", metavar="S",
                        help='warn after S seconds when no process of the run has hooked anything (default 60; "off")')
    # dest "program": the top-level parser's "command" is the subcommand's name.
    parser.add_argument("program", nargs=argparse.REMAINDER, metavar="COMMAND",
                        help="the program and its arguments (after --)")


def prepare(args: argparse.Namespace, environ: Mapping[str, str], pid: int) -> tuple[list[str], dict[str, str]]:
    """The command and the environment to exec it with; ConfigError for bad input (nothing started yet)."""
    from telemetry.hook import run_order as order
    from telemetry.hook.config import parse_port, parse_target_list
    from telemetry.run import boot
    from telemetry.safefs import ensure_private_dir

    command = program_of(args)
    if not command:
        raise ConfigError(f"no command given: expected {USAGE}")
    env = dict(environ)
    if args.targets is not None:
        parse_target_list("--targets", args.targets)
        env[hook_env.TARGETS] = args.targets
    if not env.get(hook_env.TARGETS, "").strip():
        raise ConfigError(f'no hook targets: give --targets SPEC or set {hook_env.TARGETS} ("package.module:function", '
                          '"package.module:Class.method" or preset names, comma-separated)')
    port_text, addr = exporter_listen(args)
    if port_text is not None:
        parse_port("--port" if args.listen is None else "--listen", port_text)
        env[hook_env.PORT] = port_text
    if addr is not None:
        check_listen_addr("--addr" if args.listen is None else "--listen", addr)
        env[hook_env.ADDR] = addr
    if args.log_dir is not None:
        if not args.log_dir:
            raise ConfigError("--log-dir is empty: expected a directory path")
        env[hook_env.LOG_DIR] = args.log_dir
    if args.unresolved_after is not None:
        boot.parse_delay("--unresolved-after", args.unresolved_after)
        env[boot.UNRESOLVED_AFTER_ENV] = args.unresolved_after
    elif env.get(boot.UNRESOLVED_AFTER_ENV, "").strip():
        boot.parse_delay(boot.UNRESOLVED_AFTER_ENV, env[boot.UNRESOLVED_AFTER_ENV])
    config = boot.config_from_env(env)   # every MEMTEL_* variable, as each process will read it
    if config is None:
        raise ConfigError(f"{hook_env.ENABLE}={env.get(hook_env.ENABLE, '')!r} turns the hook off: memtel run has "
                          f"nothing to do (unset {hook_env.ENABLE}, or run the command without memtel run)")
    if config.log_dir is not None:
        ensure_private_dir(config.log_dir, what="call-log directory")   # refused here, not in every process
    executable = _resolve(command[0], env.get("PATH", os.defpath))
    run_dir = order.create_run_dir(order.runtime_base(env), pid)
    env[order.RUN_DIR_ENV] = str(run_dir)
    python_path = env.get("PYTHONPATH", "")
    if python_path.split(os.pathsep)[0] != BOOTSTRAP_DIR:
        env["PYTHONPATH"] = BOOTSTRAP_DIR + (os.pathsep + python_path if python_path else "")
    return [executable, *command[1:]], env


def exporter_listen(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(MEMTEL_PORT, MEMTEL_ADDR) as `--listen HOST:PORT|off` (or the hidden `--port` / `--addr`) sets them; None:
    left as the environment has it."""
    if args.listen is None:
        return args.port, args.addr
    if args.port is not None or args.addr is not None:
        raise ConfigError("--listen HOST:PORT says both: give it without --addr and --port")
    if args.listen == "off":
        return "off", None
    from telemetry.exporter import parse_listen

    host, base = parse_listen(args.listen, "--listen")
    return str(base), host


def check_listen_addr(flag: str, addr: str) -> None:
    """ConfigError unless `addr` is an address of this machine an exporter can listen on (bound once, released)."""
    import socket

    if not addr.strip():
        raise ConfigError(f"{flag} is empty: expected an address of this machine to listen on (e.g. 127.0.0.1)")
    try:
        infos = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.bind(infos[0][4])
    except (OSError, UnicodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise ConfigError(f"{flag} {addr!r}: cannot listen there ({reason}); expected an address of this machine "
                          "(e.g. 127.0.0.1, or 0.0.0.0 for every interface)") from None


def _resolve(name: str, path: str) -> str:
    if os.sep in name:
        if not os.path.exists(name):
            raise CommandNotFound(f"command not found: {name}")
        if os.path.isdir(name) or not os.access(name, os.X_OK):
            raise CommandNotExecutable(f"command is not executable: {name}")
        return name
    found = shutil.which(name, path=path)
    if found is None:
        raise CommandNotFound(f"command not found: {name} (not in PATH)")
    return found


def run(args: argparse.Namespace) -> int:
    command, env = prepare(args, os.environ, os.getpid())
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(command[0], [program_of(args)[0], *command[1:]], env)
    except OSError as exc:
        raise CommandNotExecutable(f"cannot run {command[0]}: {exc.strerror}") from None
    return 0   # not reached: execve replaced this process


def program_of(args: argparse.Namespace) -> list[str]:
    """The command as the user wrote it (argv[0] stays `python`, not the resolved path: the program sees
    what it would have seen without memtel)."""
    command = list(args.program)
    return command[1:] if command[:1] == ["--"] else command
