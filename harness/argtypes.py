"""argparse types shared by the harness's commands: each names what it expects when the text is wrong."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T", int, float)


def checked(convert: Callable[[str], T], accept: Callable[[T], bool], expected: str) -> Callable[[str], T]:
    """An argparse type: `convert` the text, then require `accept(value)`; errors say what is expected."""

    def parse(text: str) -> T:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return parse


positive_int = checked(int, lambda v: v >= 1, "a positive integer")
non_negative_int = checked(int, lambda v: v >= 0, "an integer >= 0")
fraction = checked(float, lambda v: 0 < v <= 1, "a number in (0, 1]")
non_negative = checked(float, lambda v: v >= 0, "a number >= 0")
positive = checked(float, lambda v: v > 0, "a number > 0")
port = checked(int, lambda v: 1 <= v <= 65535, "a port number in 1..65535")

__all__ = ["checked", "fraction", "non_negative", "non_negative_int", "port", "positive", "positive_int"]
