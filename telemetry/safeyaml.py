"""YAML from files a user (or an attacker) wrote: bounded in size, depth and expansion, one-line errors.

PyYAML's `safe_load` builds no arbitrary objects, but it still expands aliases (a "billion laughs"
file of a few hundred bytes becomes a structure too large to walk), recurses without bound on deep
nesting (RecursionError), reads integers of any length (ValueError past Python's digit limit) and
reads non-UTF-8 bytes with a decoding error. Every one of those becomes a `ConfigError` here, whose
message names the file and says what is expected.
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from telemetry.errors import ConfigError

MAX_CONFIG_BYTES = 1 << 20  # a daemon, web or ladder config is a few kilobytes
MAX_DEPTH = 32  # deeper than any memtel config needs


class _NoAliasLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases (`*name`) and nesting deeper than MAX_DEPTH."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not accepted in memtel configs",
                                              event.start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_yaml_text(text: str, where: str) -> Any:
    """Parse `text` (from `where`, for messages); ConfigError on anything but a plain, bounded document."""
    loader = _NoAliasLoader(text)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {_one_line(exc)}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply (at most {MAX_DEPTH} levels)") from None
    except ValueError as exc:  # e.g. an integer longer than Python converts (4,300 digits)
        raise ConfigError(f"{where}: a value cannot be read: {exc}") from None
    finally:
        loader.dispose()


def load_yaml_file(path: str | os.PathLike[str], what: str = "config file",
                   max_bytes: int = MAX_CONFIG_BYTES) -> Any:
    """Read and parse a YAML file of at most `max_bytes`, UTF-8; ConfigError names the file."""
    from telemetry.safefs import FileTooLargeError, read_capped

    try:
        data = read_capped(path, max_bytes, follow_symlinks=True)
    except FileTooLargeError:
        raise ConfigError(f"{what} {path} is larger than {max_bytes} bytes; expected a small YAML file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte {exc.start}); expected a YAML file") from None
    return load_yaml_text(text, str(path))


def _one_line(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem:
        mark = exc.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        context = f"{exc.context}: " if exc.context else ""
        return " ".join(f"{context}{exc.problem}{where}".split())
    return " ".join(str(exc).split())


__all__ = ["MAX_CONFIG_BYTES", "MAX_DEPTH", "load_yaml_file", "load_yaml_text"]
