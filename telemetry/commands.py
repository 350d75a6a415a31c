"""How a package adds a `memtel` subcommand without telemetry naming it: the `memtel.commands` entry points.

A package above telemetry (the harness) declares, in its distribution's metadata,

    [project.entry-points."memtel.commands"]
    demo = "harness.commands:DEMO"

where `DEMO` is a `Command`: the module that holds the subcommand's `configure(parser)` and `run(args)`, its one
line of help, and the extra that installs what it needs. Loading an entry point imports only the small module that
declares it, never the command itself, so `memtel --help` lists every command without importing any.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import metadata

log = logging.getLogger("memtel.cli")

GROUP = "memtel.commands"


@dataclass(frozen=True)
class Command:
    module: str  # imported only when the command is chosen
    help: str  # one line, shown by `memtel --help`
    extra: str = ""  # the extra of memtel's distribution that installs its packages ("" for the core)


def registered_commands(group: str = GROUP) -> dict[str, Command]:
    """The commands other packages register, by name in name order; an entry that does not load or is not a
    `Command` is left out and logged (a broken plugin must not take the whole command line with it)."""
    commands: dict[str, Command] = {}
    for entry in sorted(metadata.entry_points(group=group), key=lambda e: e.name):
        try:
            command = entry.load()
        except Exception as exc:  # any import error of a third party's module
            log.warning("memtel: the command %r (%s) could not be loaded: %s", entry.name, entry.value, exc)
            continue
        if not isinstance(command, Command):
            log.warning("memtel: the command %r (%s) is not a telemetry.commands.Command", entry.name, entry.value)
            continue
        commands.setdefault(entry.name, command)
    return commands


__all__ = ["GROUP", "Command", "registered_commands"]
