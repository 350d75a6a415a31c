"""The live forecast's settings: which prefill lengths, how often, and a workload given in text.

Pure parsers, used by `HookConfig` (telemetry/hook/config.py) for MEMTEL_FORECAST_TOKENS,
MEMTEL_FORECAST_INTERVAL_S and MEMTEL_FORECAST_SHAPE and for the same `install()` options. Each says
in one line what was wrong and what is expected (ConfigError). Nothing here imports the model
(telemetry/model): a shape text is turned into a workload only when it is given (telemetry/hook/forecast/workload.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from telemetry import hook_env
from telemetry.errors import ConfigError

# A forecast's cost grows with the prefill's length (its chunk steps times the indexer layers) and is paid
# for every length at every interval: the lengths and their number are bounded.
MAX_FORECAST_TOKENS = 2_000_000   # prompts reach 1M tokens; the cost grows with the square of the length
MAX_FORECAST_LENGTHS = 8
DEFAULT_INTERVAL_S = 5.0
MIN_INTERVAL_S = 1.0
MAX_INTERVAL_S = 3600.0

_TOKENS_EXPECTED = (f"expected up to {MAX_FORECAST_LENGTHS} prefill lengths in tokens, integers in "
                    f"1..{MAX_FORECAST_TOKENS:,} separated by commas (e.g. 100000,200000)")
_INTERVAL_EXPECTED = f"expected a number of seconds in {MIN_INTERVAL_S:g}..{MAX_INTERVAL_S:g}"


def _token_count(item: object, name: str, shown: object) -> int:
    if isinstance(item, str):
        text = item.strip().replace("_", "")
        # str.isdigit() alone accepts other scripts' digits, which int() then reads.
        if not (text.isascii() and text.isdigit()):
            raise ConfigError(f"{name}={shown!r}: {item.strip()!r} is not a token count; {_TOKENS_EXPECTED}")
        value = int(text)
    elif isinstance(item, int) and not isinstance(item, bool):
        value = item
    else:
        raise ConfigError(f"{name}={shown!r}: {item!r} is not a token count; {_TOKENS_EXPECTED}")
    if not 1 <= value <= MAX_FORECAST_TOKENS:
        raise ConfigError(f"{name}={shown!r}: {value:,} is out of range; {_TOKENS_EXPECTED}")
    return value


def check_tokens(value: object, name: str = "forecast_tokens") -> tuple[int, ...]:
    """Prefill lengths from text ("100000,200000"), a list of ints or None (off): sorted, deduplicated."""
    if value is None:
        return ()
    if isinstance(value, str):
        items: list[object] = [part for part in value.split(",") if part.strip()]
        if not items and value.strip():
            raise ConfigError(f"{name}={value!r}: {_TOKENS_EXPECTED}")
    elif isinstance(value, Iterable) and not isinstance(value, (bytes, dict)):
        items = list(value)
    else:
        raise ConfigError(f"{name}={value!r}: {_TOKENS_EXPECTED}")
    counts = sorted({_token_count(item, name, value) for item in items})
    if len(counts) > MAX_FORECAST_LENGTHS:
        raise ConfigError(f"{name}={value!r}: {len(counts)} lengths; {_TOKENS_EXPECTED}")
    return tuple(counts)


def check_interval(value: object, name: str = "forecast_interval_s") -> float:
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise ConfigError(f"{name}={value!r} is not a number of seconds; {_INTERVAL_EXPECTED}") from None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        raise ConfigError(f"{name}={value!r} is not a number of seconds; {_INTERVAL_EXPECTED}")
    if not (math.isfinite(number) and MIN_INTERVAL_S <= number <= MAX_INTERVAL_S):
        raise ConfigError(f"{name}={value!r} is out of range; {_INTERVAL_EXPECTED}")
    return number


# MEMTEL_FORECAST_SHAPE: key=value pairs, the keys IndexerShape's fields (the budget in MiB, as on command
# lines) and the width mode. Unnamed keys keep the reference workload's values.
SHAPE_KEYS = ("layers", "chunk", "compress_ratio", "max_model_len", "budget_mb", "fixed_width", "topk", "mode")


def parse_shape_pairs(text: str, name: str = hook_env.FORECAST_SHAPE) -> dict[str, str]:
    """`key=value,key=value` -> {key: value}; an unknown or repeated key is an error that lists the valid ones."""
    pairs: dict[str, str] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, raw = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not raw.strip():
            raise ConfigError(f"{name}: {part.strip()!r} is not key=value; expected e.g. "
                              "layers=61,chunk=8192,max_model_len=163840,compress_ratio=1,budget_mb=512,mode=stock")
        if key not in SHAPE_KEYS:
            raise ConfigError(f"{name}: unknown key {key!r}; valid keys: {', '.join(SHAPE_KEYS)}")
        if key in pairs:
            raise ConfigError(f"{name}: {key!r} given twice")
        pairs[key] = raw.strip()
    if not pairs:
        raise ConfigError(f"{name}={text!r}: expected key=value pairs ({', '.join(SHAPE_KEYS)})")
    return pairs


__all__ = ["DEFAULT_INTERVAL_S", "MAX_FORECAST_LENGTHS", "MAX_FORECAST_TOKENS", "MAX_INTERVAL_S", "MIN_INTERVAL_S",
           "SHAPE_KEYS", "check_interval", "check_tokens", "parse_shape_pairs"]
