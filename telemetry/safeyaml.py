"""YAML from files a user (or an attacker) wrote: bounded in size, depth and expansion, one-line errors.

PyYAML's `safe_load` builds no arbitrary objects, but it still expands aliases (a "billion laughs"
file of a few hundred bytes becomes a structure too large to walk), recurses without bound on deep
nesting (RecursionError), reads integers of any length (ValueError past Python's digit limit) and
reads non-UTF-8 bytes with a decoding error. Every one of those becomes a `ConfigError` here, whose
message names the file and says what is expected.

Aliases are refused unless the caller allows them (`aliases=True`: ladder files share one `serve`
block between arms with `<<: *serve`). Allowed aliases are bounded by what they expand to: the
document, with every alias copied out, may hold at most `MAX_EXPANDED_CHARS` characters of scalars
(plus one per node) and `MAX_DEPTH` levels; a recursive alias is refused. The check walks each node
once (memoized), so a "billion laughs" file is refused in microseconds, before anything is built.
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from telemetry.errors import ConfigError

MAX_CONFIG_BYTES = 1 << 20  # a daemon, web or ladder config is a few kilobytes
MAX_DEPTH = 32  # deeper than any memtel config needs
MAX_EXPANDED_CHARS = 4 * MAX_CONFIG_BYTES  # what a document with aliases may expand to


class _NoAliasLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases (`*name`) and nesting deeper than MAX_DEPTH."""

    allow_aliases = False

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def _next_event(self) -> Any:
        return self.peek_event()  # type: ignore[no-untyped-call]  # PyYAML's method is unannotated

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent) and not self.allow_aliases:
            event = self._next_event()
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not accepted in memtel configs",
                                              event.start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels",
                                                  self._next_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _BoundedAliasLoader(_NoAliasLoader):
    """Aliases allowed; `load_yaml_text` checks what they expand to before anything is constructed."""

    allow_aliases = True


class _ExpansionError(Exception):
    pass


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a node graph whose full expansion exceeds MAX_EXPANDED_CHARS or MAX_DEPTH, or is recursive."""
    sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded characters, height)
    active: set[int] = set()

    def walk(node: yaml.Node, depth: int) -> tuple[int, int]:
        key = id(node)
        if key in active:
            raise _ExpansionError("an alias refers to a node that contains it (recursive)")
        known = sizes.get(key)
        if known is None:
            if depth > MAX_DEPTH:
                raise _ExpansionError(f"aliases nest it deeper than {MAX_DEPTH} levels")
            active.add(key)
            size, height = 1, 1
            if isinstance(node, yaml.ScalarNode):
                size += len(node.value)
            else:
                children = node.value if isinstance(node, yaml.SequenceNode) else [n for pair in node.value
                                                                                   for n in pair]
                for child in children:
                    child_size, child_height = walk(child, depth + 1)
                    size += child_size
                    height = max(height, child_height + 1)
                    if size > MAX_EXPANDED_CHARS:
                        raise _ExpansionError(f"aliases expand it past {MAX_EXPANDED_CHARS:,} characters")
            active.discard(key)
            known = sizes[key] = (size, height)
        if depth + known[1] - 1 > MAX_DEPTH:
            raise _ExpansionError(f"aliases nest it deeper than {MAX_DEPTH} levels")
        return known

    walk(root, 1)


def load_yaml_text(text: str, where: str, *, aliases: bool = False) -> Any:
    """Parse `text` (from `where`, for messages); ConfigError on anything but a plain, bounded document.

    aliases: accept `&anchor` / `*alias` (and `<<: *alias`) within the expansion bounds.
    """
    loader = (_BoundedAliasLoader if aliases else _NoAliasLoader)(text)
    try:
        if not aliases:
            return loader.get_single_data()
        root = loader.get_single_node()
        if root is None:
            return None
        try:
            _check_expansion(root)
        except _ExpansionError as exc:
            raise ConfigError(f"{where}: {exc}; expected a plain, bounded document") from None
        return loader.construct_document(root)
    except ConfigError:
        raise
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {_one_line(exc)}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply (at most {MAX_DEPTH} levels)") from None
    except ValueError as exc:  # e.g. an integer longer than Python converts (4,300 digits)
        raise ConfigError(f"{where}: a value cannot be read: {exc}") from None
    finally:
        loader.dispose()


def load_yaml_file(path: str | os.PathLike[str], what: str = "config file",
                   max_bytes: int = MAX_CONFIG_BYTES, *, aliases: bool = False) -> Any:
    """Read and parse a YAML file of at most `max_bytes`, UTF-8; ConfigError names the file.

    aliases: accept bounded aliases (see the module's docstring).
    """
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
    return load_yaml_text(text, str(path), aliases=aliases)


def _one_line(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem:
        mark = exc.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        context = f"{exc.context}: " if exc.context else ""
        return " ".join(f"{context}{exc.problem}{where}".split())
    return " ".join(str(exc).split())


__all__ = ["MAX_CONFIG_BYTES", "MAX_DEPTH", "MAX_EXPANDED_CHARS", "load_yaml_file", "load_yaml_text"]
