"""Every `memtel` help page in one style (docs/cli.md, "Help pages"), over the whole argparse tree.

The tree is built in-process from telemetry/cli.py (telemetry's commands and those the harness registers through
the `memtel.commands` entry points), walked into every subcommand and sub-subcommand: each `--help` exits 0 and
starts with its usage, each page has a description, subcommands are shown as COMMAND, addresses as HOST:PORT,
ports as PORT and URLs as URL..., choices have one case (lowercase), `--log-level` is the one shared argument
(telemetry/argtypes.py) and no help text cites an issue number.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from telemetry import cli
from telemetry.argtypes import LOG_LEVELS
from tests.support.cli import call_main, command_tree

ROOT = Path(__file__).resolve().parents[1]
ISSUE_NUMBER = re.compile(r"\bissues? \d+|#\d+\b", re.IGNORECASE)
# Flags that name a thing of one kind show it with one placeholder, whatever the command.
ADDRESS_FLAGS = re.compile(r"--(.+-)?listen$")
PORT_FLAGS = re.compile(r"--(.+-)?port$")
URL_FLAGS = {"--upstream", "--hooks", "--hook", "--daemon", "--engines"}


TREE = command_tree()
PAGES = [path for path, _ in TREE if path]


def options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            yield action


def texts(parser: argparse.ArgumentParser) -> Iterator[str]:
    yield parser.description or ""
    yield parser.epilog or ""
    for action in parser._actions:
        yield action.help or ""


def test_the_tree_holds_every_command_and_its_subcommands():
    commands = {path[0] for path in PAGES}
    assert set(cli.all_commands()) <= commands and {("lab", "serve"), ("ab", "run"), ("flight", "show")} <= set(PAGES)


@pytest.mark.parametrize("path", PAGES, ids=" ".join)
def test_every_help_page_exits_0_with_its_usage_and_a_description(path):
    result = call_main([*path, "--help"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: memtel {' '.join(path)} ") and result.stderr == ""
    parser = dict(TREE)[path]
    assert parser.description and parser.description.strip(), f"memtel {' '.join(path)} has no description"


def test_subcommands_are_shown_as_command_everywhere():
    shown = {path: action.metavar for path, parser in TREE for action in parser._actions
             if isinstance(action, argparse._SubParsersAction)}
    assert shown and all(metavar == "COMMAND" for metavar in shown.values()), shown


def test_addresses_ports_and_urls_have_one_placeholder_each():
    wrong = []
    for path, parser in TREE:
        for action in options(parser):
            flag = action.option_strings[-1]
            expected = ("HOST:PORT" if ADDRESS_FLAGS.match(flag) else "PORT" if PORT_FLAGS.match(flag)
                        else "URL" if flag in URL_FLAGS else None)
            if expected is not None and not str(action.metavar).startswith(expected):
                wrong.append((path, flag, action.metavar))
    assert not wrong, wrong


def test_an_address_to_listen_on_is_spelled_listen_host_port_on_every_page():
    """Issue 40: `--listen HOST:PORT`, `--host` + `--port`, `--addr` + `--port` for one thing. The old spellings
    still work where scripts use them (lab serve, run), but no page shows them."""
    shown = [(path, flag) for path, parser in TREE for action in options(parser) if action.help != argparse.SUPPRESS
             for flag in action.option_strings
             if flag in ("--host", "--addr", "--port", "--memtel-port", "--bind", "--address")]
    assert not shown, shown
    listens = {path for path, parser in TREE for action in options(parser) if "--listen" in action.option_strings}
    assert {("daemon",), ("guard",), ("lab", "serve"), ("run",), ("alerts", "burn-in")} <= listens
    hook_listen = [a for path, parser in TREE if path == ("lab", "serve") for a in options(parser)
                   if "--hook-listen" in a.option_strings]
    assert [a.metavar for a in hook_listen] == ["HOST:PORT"]


def test_choices_have_one_case():
    upper = [(path, action.option_strings or action.dest, list(action.choices))
             for path, parser in TREE for action in parser._actions
             if action.choices and not isinstance(action, argparse._SubParsersAction)
             and any(isinstance(c, str) and c != c.lower() for c in action.choices)]
    assert not upper, upper


def test_log_level_is_one_argument_lowercase_accepting_either_case():
    found = {path: action for path, parser in TREE for action in options(parser)
             if "--log-level" in action.option_strings}
    assert {("daemon",), ("guard",), ("lab", "serve")} <= set(found)
    for path, action in found.items():
        assert tuple(action.choices) == LOG_LEVELS, path
        assert action.type("WARNING") == "warning" and action.type(" Debug ") == "debug"
        with pytest.raises(argparse.ArgumentTypeError, match="expected one of debug, info, warning, error"):
            action.type("loud")


def test_no_help_text_cites_an_issue_number():
    cited = [(path, text) for path, parser in TREE for text in texts(parser) if ISSUE_NUMBER.search(text)]
    assert not cited, cited


def test_help_works_without_the_harness_extra():
    # The harness's commands register through entry points; their --help must not need the extra's packages
    # (httpx, rich, matplotlib, numpy): those are imported when the command runs, which then says what to install.
    code = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in {'httpx', 'rich', 'matplotlib', 'numpy'}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from telemetry.cli import main\n"
        "for argv in (['lab', '--help'], ['lab', 'serve', '--help'], ['demo', '--help'], ['ab', 'run', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as exit_:\n"
        "        assert exit_.code == 0, (argv, exit_.code)\n"
        "print('all help pages shown')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.rstrip().endswith("all help pages shown"), result.stderr[-2000:]
