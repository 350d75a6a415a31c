"""Validation of the config files memtel reads: ladders, the daemon config, the web config.

Every value is checked with the path of the field it came from, and a bad one is one line that names
the file, that path, what was expected and what was found (`ladder.yaml: steps[2].tokens: expected an
integer >= 1,000, got 10`). `Validator` walks the data and makes those errors; `Section` declares a
mapping's keys, each with its check and its default, so a new config section is a few lines:

    PROTECT = Section({
        "enabled": Field(boolean, default=False),
        "min_headroom_mib": Field(integer(0, 1 << 20), default=1024),
    })
    values = PROTECT.read(validator, data.get("protect"), "protect")   # {"enabled": ..., ...}

A check is a function `(validator, value, path) -> typed value`; `integer`, `number`, `boolean`,
`choice`, `text` and `path_text` make the common ones, and any function of that shape is one.

The files' messages grew up apart and users (and their scripts) know them, so two wordings are kept,
chosen per file by `Wording`: a ladder names the bound a number broke (`expected an integer >= 1`) and
each unknown key at its own path; the daemon config names the whole range (`expected a number from 0
to 3600`) and lists every unknown key of a section at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from telemetry.errors import ConfigError
from telemetry.limits import MAX_TEXT_CHARS
from telemetry.url import parse_http_url

T = TypeVar("T")
MAX_SHOWN_CHARS = 80  # of a bad value quoted back in a message


@dataclass(frozen=True)
class Wording:
    """How a file's messages phrase bounds and unknown keys (see the module's docstring)."""

    range_bounds: bool  # "expected a number from 0 to 3600" (True) or "expected an integer >= 1" (False)
    unknown_keys_together: bool  # "kmsg: unknown key(s) a, b; valid keys: ..." (True) or one key at its path


LADDER = Wording(range_bounds=False, unknown_keys_together=False)
DAEMON = Wording(range_bounds=True, unknown_keys_together=True)


def join(path: str, key: str) -> str:
    """`arms[1]` + `serve` -> `arms[1].serve`; the top level has the empty path."""
    return f"{path}.{key}" if path else key


def kind(value: Any) -> str:
    """A bad value as a message shows it: its type and a bounded repr (`str 'many'`, `list`, `nothing`)."""
    if value is None:
        return "nothing"
    if isinstance(value, (dict, list)):
        return type(value).__name__
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return int_text(value)
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS] + '...'}"


def int_text(value: int) -> str:
    """An integer as a message shows it; a giant one by its size (printing 5,000 digits helps nobody)."""
    return str(value) if abs(value) < 10**30 else f"an integer of {value.bit_length():,} bits"


def _bound(value: float) -> str:
    """A bound as the daemon's messages write it: 3600, 0.01, 1048576 (never 1.04858e+06)."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


class Validator:
    """Checks values at paths; every error is `error_type("<source>: <path>: <message>")`.

    source: the file (None: the caller adds it, or the value came from a flag). top: how the empty path
    is named in a message (a ladder leaves it out; the daemon config says "top level").
    """

    def __init__(self, source: str | None, *, wording: Wording = LADDER, error_type: type[ConfigError] = ConfigError,
                 top: str = "") -> None:
        self.source = source
        self.wording = wording
        self.error_type = error_type
        self.top = top

    def fail(self, path: str, message: str) -> ConfigError:
        """The error to raise for the field at `path` (the caller raises it, so control flow stays visible)."""
        parts = [p for p in (self.source, path or self.top) if p]
        return self.error_type(": ".join([*parts, message]))

    # -- containers --

    def mapping(self, data: Any, path: str, required: tuple[str, ...] = (), optional: tuple[str, ...] = (),
                unsupported: Mapping[str, str] | None = None) -> dict[Any, Any]:
        """`data` as a mapping whose keys are all known, with every required key present and not null.

        unsupported: keys that are known but refused, with the reason (said at the key's path).
        """
        valid = required + optional
        if not isinstance(data, dict):
            raise self.fail(path, f"expected a mapping with keys {', '.join(valid)}, got {kind(data)}")
        for key in data:
            if unsupported and key in unsupported:
                raise self.fail(join(path, str(key)), unsupported[key])
        unknown = [key for key in data if key not in valid]
        if unknown and self.wording.unknown_keys_together:
            names = ", ".join(sorted({str(k)[:64] for k in unknown}))
            raise self.fail(path, f"unknown key(s) {names}; valid keys: {', '.join(valid)}")
        if unknown:
            key = unknown[0]
            raise self.fail(join(path, str(key)), f"unknown key {key!r}; valid keys here: {', '.join(valid)}")
        for key in required:
            if data.get(key) is None:
                raise self.fail(join(path, key), "missing (required)")
        return data

    def items(self, value: Any, path: str, what: str, *, max_items: int, allow_empty: bool = False) -> list[Any]:
        """`value` as a list of at most `max_items` (`what` says what its items are, for the message)."""
        if not isinstance(value, list) or (not value and not allow_empty):
            some = "a list" if allow_empty else "a non-empty list"
            raise self.fail(path, f"expected {some} of {what}, got {kind(value)}")
        if len(value) > max_items:
            raise self.fail(path, f"expected at most {max_items:,} items, got {len(value):,}")
        return value

    # -- scalars --

    def integer(self, value: Any, path: str, minimum: int | None = None, maximum: int | None = None) -> int:
        """An integer (not a bool, not a float) within the bounds given."""
        if self.wording.range_bounds:
            return int(self._in_range(value, path, True, minimum, maximum))
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(path, f"expected an integer, got {kind(value)}")
        if minimum is not None and value < minimum:
            raise self.fail(path, f"expected an integer >= {minimum:,}, got {int_text(value)}")
        if maximum is not None and value > maximum:
            raise self.fail(path, f"expected an integer <= {maximum:,}, got {int_text(value)}")
        return value

    def number(self, value: Any, path: str, minimum: float | None = None, maximum: float | None = None) -> float:
        """A finite number (NaN and infinity are refused) within the bounds given."""
        if self.wording.range_bounds:
            return float(self._in_range(value, path, False, minimum, maximum))
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(path, f"expected a number, got {kind(value)}")
        if isinstance(value, int) and abs(value) > 2**53:
            raise self.fail(path, f"expected a number of at most 2^53, got {kind(value)}")
        if not math.isfinite(value):
            raise self.fail(path, f"expected a finite number, got {value}")
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            low = "" if minimum is None else f"{minimum:g}"
            high = "" if maximum is None else f"{maximum:g}"
            raise self.fail(path, f"expected a number in [{low}, {high}], got {value:g}")
        return float(value)

    def _in_range(self, value: Any, path: str, whole: bool, minimum: float | None, maximum: float | None) -> Any:
        low = 0.0 if minimum is None else minimum
        high = math.inf if maximum is None else maximum
        what = "an integer" if whole else "a number"
        bounds = f"from {_bound(low)} to {_bound(high)}" if math.isfinite(high) else f">= {_bound(low)}"
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
            raise self.fail(path, f"expected {what} {bounds}, got {kind(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise self.fail(path, f"expected a finite number {bounds}, got {value!r}")
        if not low <= value <= high:
            shown = int_text(value) if isinstance(value, int) else f"{value!r}"
            raise self.fail(path, f"expected {what} {bounds}, got {shown}")
        return value

    def boolean(self, value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(path, f"expected true or false, got {kind(value)}")
        return value

    def choice(self, value: Any, path: str, choices: tuple[str, ...]) -> str:
        if not isinstance(value, str) or value not in choices:
            shown = repr(value) if isinstance(value, str) and len(value) <= MAX_SHOWN_CHARS else kind(value)
            raise self.fail(path, f"expected one of {', '.join(choices)}, got {shown}")
        return value

    def text(self, value: Any, path: str, max_chars: int = MAX_TEXT_CHARS) -> str:
        """Non-empty text of at most `max_chars` characters without a NUL."""
        if not isinstance(value, str) or not value.strip():
            raise self.fail(path, f"expected a non-empty string, got {kind(value)}")
        if len(value) > max_chars:
            raise self.fail(path, f"expected at most {max_chars:,} characters, got {len(value):,}")
        if "\0" in value:
            raise self.fail(path, "contains a NUL character")
        return value

    def url(self, value: Any, path: str) -> str:
        """An http(s) URL with a host (and a valid port, if any), as written, without a trailing slash: its
        credentials, if any, stay for the client that sends them (telemetry/url.py parses it; its refusal reads
        `expected an http(s) URL such as http://127.0.0.1:8000, got 'x', which has no scheme`)."""
        url = self.text(value, path)
        try:
            parse_http_url(url, "")
        except ConfigError as error:
            raise self.fail(path, str(error)) from None
        return url.strip().rstrip("/")

    def path_text(self, value: Any, path: str, max_chars: int = MAX_TEXT_CHARS) -> str:
        """A file system path: non-empty text of at most `max_chars` characters without a NUL."""
        if not isinstance(value, str) or not value or len(value) > max_chars or "\0" in value:
            raise self.fail(path, f"expected a path, got {kind(value)}")
        return value


# -- declarative sections -----------------------------------------------------------------------------
Check = Callable[[Validator, Any, str], T]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # a Field's default when the key must be given


@dataclass(frozen=True)
class Field(Generic[T]):
    """One key of a section: its check, and its default when the key is absent (REQUIRED: no default).

    A key given as null (`key:` with nothing after it) is checked like any value, unless `null_is_default`.
    """

    check: Check[T]
    default: Any = REQUIRED
    null_is_default: bool = False


@dataclass(frozen=True)
class Section:
    """A mapping's keys in the order they are documented, each with its check.

    unsupported: keys that are known but refused, with the reason (e.g. the web config's rate_limit).
    null_is_empty: a section given as null (`kmsg:` with nothing under it) reads as an empty mapping.
    """

    fields: Mapping[str, Field[Any]]
    unsupported: Mapping[str, str] | None = None
    null_is_empty: bool = True

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self.fields)

    def read(self, validator: Validator, data: Any, path: str) -> dict[str, Any]:
        """Each key's checked value (its default where absent); errors name `path` and the key."""
        if data is None and self.null_is_empty:
            data = {}
        required = tuple(k for k, f in self.fields.items() if f.default is REQUIRED)
        optional = tuple(k for k in self.fields if k not in required)
        data = validator.mapping(data, path, required, optional, self.unsupported)
        out: dict[str, Any] = {}
        for key, spec in self.fields.items():
            if key not in data or (data[key] is None and spec.null_is_default):
                out[key] = spec.default
            else:
                out[key] = spec.check(validator, data[key], join(path, key))
        return out


def integer(minimum: int | None = None, maximum: int | None = None) -> Check[int]:
    return lambda v, value, path: v.integer(value, path, minimum, maximum)


def number(minimum: float | None = None, maximum: float | None = None) -> Check[float]:
    return lambda v, value, path: v.number(value, path, minimum, maximum)


def boolean(v: Validator, value: Any, path: str) -> bool:
    return v.boolean(value, path)


def choice(*choices: str) -> Check[str]:
    return lambda v, value, path: v.choice(value, path, choices)


def text(max_chars: int = MAX_TEXT_CHARS) -> Check[str]:
    return lambda v, value, path: v.text(value, path, max_chars)


def path_text(v: Validator, value: Any, path: str) -> str:
    return v.path_text(value, path)


def optional(check: Check[T]) -> Check[T | None]:
    """`check`, except that null stays None (an optional key written with no value)."""
    return lambda v, value, path: None if value is None else check(v, value, path)


__all__ = ["DAEMON", "LADDER", "REQUIRED", "Check", "Field", "Section", "Validator", "Wording", "boolean", "choice",
           "integer", "join", "kind", "number", "optional", "path_text", "text"]
