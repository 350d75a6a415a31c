"""The run directory: names that may become file names, paths that stay inside it, private modes.

Arm names and step labels name files (`prompts/<label>-r<repeat>.txt`, `logs/<arm>-r<repeat>-serve.log`,
`hook-logs/<arm>-r<repeat>`), so they are limited to `SAFE_NAME` (letters, digits, `.`, `_`, `-`,
starting with a letter or digit) when the ladder is loaded; a path that is still built from input
(`serve.log_file`) is resolved and must stay inside the run directory (`inside_run_dir`), symbolic links
included. A run's files hold prompts, replies and the servers' logs: the harness creates them with
mode 0600 and its directories 0700 (`private_files`), whatever the user's umask; the served command
keeps the user's own umask.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

from telemetry.errors import ConfigError
from telemetry.limits import MAX_NAME_CHARS

SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
SAFE_NAME_TEXT = "letters, digits, '.', '_' or '-', starting with a letter or digit"
PRIVATE_UMASK = 0o077


class UnsafeRunPathError(ConfigError):
    """A path built from a ladder would leave the run directory."""


def name_problem(name: str) -> str | None:
    """Why `name` cannot name a file in the run directory, or None when it can."""
    if len(name) > MAX_NAME_CHARS:
        return f"at most {MAX_NAME_CHARS} characters (it names files), got {len(name)}"
    if not SAFE_NAME.fullmatch(name):
        return f"use {SAFE_NAME_TEXT} (it names files), got {name!r}"
    return None


def relative_path_problem(path: str) -> str | None:
    """Why `path` cannot be a path relative to the run directory (absolute, or with `..`), or None."""
    if "\0" in path:
        return "contains a NUL character"
    parts = Path(path).parts
    if Path(path).is_absolute() or not parts:
        return f"expected a path relative to the run directory, got {path!r}"
    if ".." in parts:
        return f"'..' would leave the run directory: {path!r}"
    return None


def inside_run_dir(run_dir: Path, relative: str | Path, what: str = "path") -> Path:
    """`run_dir / relative`, refused (UnsafeRunPathError) unless it resolves inside run_dir."""
    base = Path(os.path.realpath(run_dir))
    target = Path(os.path.realpath(base / relative))
    if target != base and base not in target.parents:
        raise UnsafeRunPathError(f"{what} {relative} resolves to {target}, outside the run directory {base}; "
                                 "expected a path inside it (no '..', absolute path or symbolic link out)")
    return base / relative


@contextlib.contextmanager
def private_files() -> Iterator[int]:
    """Files and directories created meanwhile get 0600 / 0700; yields the previous umask (for children)."""
    previous = os.umask(PRIVATE_UMASK)
    try:
        yield previous
    finally:
        os.umask(previous)


def current_umask() -> int:
    mask = os.umask(PRIVATE_UMASK)
    os.umask(mask)
    return mask


__all__ = ["SAFE_NAME", "SAFE_NAME_TEXT", "UnsafeRunPathError", "current_umask", "inside_run_dir", "name_problem",
           "private_files", "relative_path_problem"]
