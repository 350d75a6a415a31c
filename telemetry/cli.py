"""The `memtel` command line: one entry point, one module per subcommand.

Each subcommand lives in its own module that exposes ``configure(parser)`` (adds its
arguments) and ``run(args) -> int`` (the exit status). Modules are imported only when
their subcommand is chosen, so `memtel daemon` never imports torch or matplotlib.

telemetry's own commands are listed here (`COMMANDS`). A package above telemetry (the harness) adds its commands
through the `memtel.commands` entry-point group, as vLLM's plugins register (pyproject.toml): each entry names
a `Command` (telemetry/commands.py), so this module names no module of a higher package.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, NoReturn

from telemetry.commands import Command, registered_commands

# telemetry's commands, one `Command` each (its module holds `configure(parser)` and `run(args)`). Order is the
# order shown by `memtel --help`; the commands registered by other packages (`memtel.commands` entry points) follow.
COMMANDS: dict[str, Command] = {
    "daemon": Command("telemetry.daemon.cli", "run the node exporter: host memory, swap, PSI, NVML, kernel log"),
    "flight": Command("telemetry.flight.cli",
                      "show the flight recorder's last records (this boot or the previous one)"),
    "alerts": Command("telemetry.alerts.cli",
                      "score alert rules against timelines of real outcomes; burn them in here"),
    "run": Command("telemetry.run.cli",
                   "run any Python program with the hook in it and in every Python process it starts"),
    "ledger": Command("telemetry.ledger.cli",
                      "where the memory is: per node, then per process (weights, KV, outside...)"),
    "top": Command("telemetry.ledger.top_cli",
                   "the ledger live in the terminal: headroom, processes, growth, kernel log"),
    "guard": Command("telemetry.guard.cli",
                     "an OpenAI-compatible proxy that refuses prompts whose prefill would not fit"),
    "allocsim": Command("telemetry.model.allocsim.cli", "replay an op file on the caching-allocator simulator"),
    "replay": Command("telemetry.model.indexer.replay_cli",
                      "replay the sparse indexer's logits allocations alone (cuda or sim)"),
    "forecast": Command("telemetry.model.indexer.forecast_cli",
                        "forecast the next prefill's reserved growth from an allocator snapshot"),
    "tune": Command("telemetry.tune.cli",
                    "search allocator, budget and chunk settings for the longest prefill that fits"),
    "whatif": Command("telemetry.model.allocsim.whatif_cli",
                      "replay a recorded memory history under other allocator settings"),
}


def all_commands() -> dict[str, Command]:
    """Every command: telemetry's, then those other installed packages register (a name of telemetry's wins)."""
    commands = dict(COMMANDS)
    for name, command in registered_commands().items():
        commands.setdefault(name, command)
    return commands


def error_line(command: str, message: str) -> str:
    """The one form of every command's error line: `memtel CMD: error: what was wrong (what is expected)`.

    Commands raise ConfigError / RunError (telemetry/errors.py) and never print their own; warnings and notes
    keep the same prefix with `warning:` / `note:`. Whatever the message quotes, each of its lines reaches the
    terminal cut to MAX_ERROR_CHARS with its control characters escaped (telemetry.errors.printable).
    """
    from telemetry.errors import MAX_ERROR_CHARS, printable

    safe = "\n".join(printable(line, MAX_ERROR_CHARS) for line in message.split("\n"))
    return f"{command}: error: {safe}"


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (without its usage block), like every other bad input.

    Subparsers are made of the parser's own class, so every subcommand and sub-subcommand inherits it.
    """

    def error(self, message: str) -> NoReturn:
        print(error_line(self.prog, f"{message} (see {self.prog} --help)"), file=sys.stderr)
        sys.exit(2)


def _missing_package_line(name: str, command: Command, exc: ModuleNotFoundError) -> str | None:
    """The one line for a package of an extra that is not installed (None: the error is memtel's own)."""
    missing = (exc.name or "").split(".")[0]
    if missing in ("", "telemetry", command.module.split(".")[0]):
        return None
    extra = f"memtel[{command.extra}]" if command.extra else "memtel"
    return error_line(f"memtel {name}", f"it needs the Python package {missing!r}, which is not installed here: "
                      f"install it with pip install '{extra}'")


def _import_command(name: str, command: Command) -> Any:
    """The subcommand's module; a package of an extra that is not installed is one line and exit 2 (also when
    the command imports it only once it runs: `run_command`)."""
    try:
        return importlib.import_module(command.module)
    except ModuleNotFoundError as exc:
        line = _missing_package_line(name, command, exc)
        if line is None:
            raise
        print(line, file=sys.stderr)
        sys.exit(2)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    from telemetry import __version__

    parser = OneLineArgumentParser(prog="memtel", description="GPU memory growth telemetry and A/B testing.")
    parser.add_argument("--version", action="version", version=f"memtel {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in all_commands().items():
        sub_parser = sub.add_parser(name, help=command.help, description=command.help)
        if only is None or name == only:
            module = _import_command(name, command)
            module.configure(sub_parser)
            sub_parser.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    if chosen not in all_commands():
        chosen = None
    # Import only the chosen subcommand's module; `memtel --help` lists names without importing any.
    parser = build_parser(only=chosen or "")
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # one line, like every other bad input (argparse would add its usage block)
        chosen_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    args._prog = chosen_parser(parser, args).prog
    return run_command(args)


def chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The deepest (sub-)subcommand `args` chose: `memtel lab serve`'s parser, whose prog names its errors."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            child = action.choices.get(getattr(args, action.dest, None) or "")
            if child is not None:
                return chosen_parser(child, args)
    return parser


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed subcommand; every `MemtelError` becomes one line on stderr, named for the (sub-)subcommand
    that ran (`memtel lab serve: error: ...`), and its exit code."""
    from telemetry.errors import INTERRUPTED, MemtelError

    prog = getattr(args, "_prog", None) or f"memtel {args.command}"
    try:
        return int(args._run(args) or 0)
    except MemtelError as exc:
        print(error_line(prog, str(exc)), file=sys.stderr)
        return exc.exit_code
    except ModuleNotFoundError as exc:  # a package of an extra, imported where the command first needs it
        line = _missing_package_line(args.command, all_commands()[args.command], exc)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
