"""Durations as people type them: `900`, `90s`, `15m`, `2h`, `1d` (seconds when there is no unit)."""

from __future__ import annotations

import math
import re

from telemetry.errors import ConfigError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(text: str, where: str) -> float:
    """Seconds; ConfigError (naming `where`) for anything that is not a finite positive duration."""
    match = _DURATION.match(str(text)[:64])
    if not match:
        raise ConfigError(f"{where}: {str(text)[:64]!r} is not a duration (expected e.g. 120s, 15m, 2h or seconds)")
    seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"{where}: {text!r} is not a positive duration")
    return seconds
