"""argparse types shared by the harness's commands: each names what it expects when the text is wrong.

Numbers are finite (NaN and infinity are refused: `float("nan") >= 0` is False but `inf >= 0` is True,
and either fails later, after something started), integers are ASCII digits (Python's `int` reads
"１２" too) and every type can carry an upper bound (telemetry/limits.py), so a flag cannot ask for a
structure larger than the machine. A bad value is one line naming the flag (telemetry/cli.py).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

from telemetry.errors import shown

T = TypeVar("T", int, float)

MAX_SHOWN_CHARS = 40  # a 5,000-digit argument is cut in the message


class _NotFinite(ValueError):
    pass


def _integer(text: str) -> int:
    stripped = text.strip().replace("_", "")
    digits = stripped[1:] if stripped[:1] in "+-" else stripped
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 30:
        raise ValueError(text)
    return int(stripped)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotFinite(text)
    return value


def number_text(value: float) -> str:
    """1048576.0 as 1,048,576; 0.05 as 0.05."""
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


def checked(convert: Callable[[str], T], accept: Callable[[T], bool], expected: str,
            maximum: T | None = None) -> Callable[[str], T]:
    """An argparse type: `convert` the text, then require `accept(value)` and `value <= maximum`; errors say
    what is expected."""

    def parse(text: str) -> T:
        try:
            value = convert(text)
        except _NotFinite:
            raise argparse.ArgumentTypeError(
                f"expected {expected} (a finite number), got {shown(text, MAX_SHOWN_CHARS)}") from None
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {shown(text, MAX_SHOWN_CHARS)}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {shown_value(value)}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"expected at most {number_text(maximum)}, got {shown_value(value)}")
        return value

    return parse


def shown_value(value: float) -> str:
    text = str(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS] + "..."


def bounded_int(minimum: int, maximum: int) -> Callable[[str], int]:
    """An integer in [minimum, maximum] (ASCII digits)."""
    expected = {0: "an integer >= 0", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum:,}")
    return checked(_integer, lambda v: v >= minimum, expected, maximum)


def bounded_float(minimum: float, maximum: float, *, above_minimum: bool = False) -> Callable[[str], float]:
    """A finite number in [minimum, maximum] (or (minimum, maximum] with `above_minimum`)."""
    expected = f"a number {'>' if above_minimum else '>='} {number_text(minimum)}"
    return checked(_finite, (lambda v: v > minimum) if above_minimum else (lambda v: v >= minimum), expected,
                   maximum)


positive_int = checked(_integer, lambda v: v >= 1, "a positive integer")
non_negative_int = checked(_integer, lambda v: v >= 0, "an integer >= 0")
fraction = checked(_finite, lambda v: 0 < v <= 1, "a number in (0, 1]")
non_negative = checked(_finite, lambda v: v >= 0, "a number >= 0")
positive = checked(_finite, lambda v: v > 0, "a number > 0")
port = checked(_integer, lambda v: 1 <= v <= 65535, "a port number in 1..65535")
finite = checked(_finite, lambda v: True, "a number")

LOG_LEVELS = ("debug", "info", "warning", "error")


def log_level(text: str) -> str:
    """A `--log-level`: one of LOG_LEVELS in either case, returned lowercase (the one form help shows)."""
    value = text.strip().lower()
    if value not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)} (either case), "
                                         f"got {shown(text, MAX_SHOWN_CHARS)}")
    return value


def add_log_level(parser: argparse.ArgumentParser, default: str | None = "info") -> None:
    """Every server command's `--log-level`, alike (`logging.basicConfig(level=args.log_level.upper())`)."""
    shown_default = f"default {default}" if default is not None else "default: the config file's, else info"
    parser.add_argument("--log-level", type=log_level, choices=LOG_LEVELS, default=default,
                        help=f"how much to log, either case ({shown_default})")


__all__ = ["LOG_LEVELS", "add_log_level", "bounded_float", "bounded_int", "checked", "finite", "fraction",
           "log_level", "non_negative", "non_negative_int", "number_text", "port", "positive", "positive_int", "shown",
           "shown_value"]
