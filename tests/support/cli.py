"""`memtel ARGV` in the test's own process, through the CLI's entry function: for bad inputs, in milliseconds
instead of a Python start each.

`telemetry.cli.main` is what the `memtel` console script calls; its return value is the exit status. A test
that needs the status as the shell sees it, a blocked call that must be timed out, or a memory limit, runs
the console script in a subprocess instead (a few cases per command keep doing so).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import subprocess
import traceback
from collections.abc import Iterator, Mapping


class ExecAttempted(AssertionError):
    """The command tried to replace this process (`memtel run` accepted its input and exec'd)."""


@contextlib.contextmanager
def _environment(env: Mapping[str, str] | None) -> Iterator[None]:
    if env is None:
        yield
        return
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _directory(cwd: str | os.PathLike[str] | None) -> Iterator[None]:
    before = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(before)


def call_main(argv: list[str], env: Mapping[str, str] | None = None,
              cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess:
    """`memtel ARGV` through `telemetry.cli.main` in this process, with `env` as the whole environment and
    `cwd` as the working directory if given: its exit status, stdout and stderr as a subprocess would give
    them. An exception out of `main` is what a traceback would have been: it goes into stderr, status 1.
    Only for commands that refuse their input, or print and return: an exec (`memtel run` accepting its
    input) raises `ExecAttempted` instead of replacing this process, and a command that starts a server
    would start it here."""
    from telemetry import cli

    def no_exec(*args: object) -> None:
        raise ExecAttempted(f"memtel {' '.join(argv)} tried to exec {args[:2]}")

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    out, err = io.StringIO(), io.StringIO()
    real_execve = os.execve
    os.execve = no_exec  # type: ignore[assignment]
    try:
        with _environment(env), _directory(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(list(argv))
            except SystemExit as exit_:  # argparse, or sys.exit(): as the console script would exit
                code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
                if isinstance(exit_.code, str):
                    err.write(exit_.code + "\n")
            except ExecAttempted:
                raise
            except Exception:
                code = 1
                err.write(traceback.format_exc())
    finally:  # a command may configure logging; leave this process's as it was
        os.execve = real_execve
        root.handlers[:] = handlers
        root.setLevel(level)
    return subprocess.CompletedProcess(["memtel", *argv], code, out.getvalue(), err.getvalue())


def command_tree() -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every page of `memtel`'s argparse tree, built in this process (telemetry's commands and those the harness
    registers), each (sub-)subcommand with its path: ((), memtel), (("lab",), ...), (("lab", "serve"), ...)."""
    from telemetry import cli

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> Iterator[
            tuple[tuple[str, ...], argparse.ArgumentParser]]:
        yield path, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    yield from walk(child, (*path, name))

    return list(walk(cli.build_parser(only=None), ()))
