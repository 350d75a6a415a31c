"""Parse `PYTORCH_CUDA_ALLOC_CONF` strings the way PyTorch's AllocatorConfig does.

Same tokens (`,` `:` `[` `]` split, whitespace dropped), same keys, same value rules and limits as
c10's AcceleratorAllocatorConfig + CUDAAllocatorConfig; where PyTorch would throw a bare `stoi`,
this names the key, the bad value and what is expected. Keys that do not change the caching
allocator's bookkeeping (pinned host memory, lock release) are accepted and ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from telemetry.errors import ConfigError

MIB = 1024 * 1024
SIZE_MAX = 2**64 - 1
LARGE_BUFFER = 20 * MIB  # kLargeBuffer
ROUNDUP_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: 1 MiB .. 64 GiB, one slot per power of two
MIN_SPLIT_MB = LARGE_BUFFER // MIB

# Keys PyTorch accepts that do not change what the device caching allocator reserves.
IGNORED_KEYS = frozenset(
    {
        "release_lock_on_cudamalloc",
        "release_lock_on_hipmalloc",
        "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register",
        "pinned_num_register_threads",
        "pinned_use_background_threads",
        "pinned_reserve_segment_size_mb",
        "pinned_max_round_threshold",
        "pinned_max_cached_size",
        "pinned_free_catch_all",
        "graph_capture_record_stream_reuse",
        "throw_on_cudamalloc_oom",
    }
)
MODELLED_KEYS = (
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "per_process_memory_fraction",
    "backend",
)


class AllocatorConfigError(ConfigError):
    """An allocator config string PyTorch would reject (or one this simulator cannot model)."""


@dataclass(frozen=True)
class AllocatorConfig:
    max_split_size: int = SIZE_MAX
    max_non_split_rounding_size: int = LARGE_BUFFER
    garbage_collection_threshold: float = 0.0
    roundup_power2_divisions: tuple[int, ...] = field(default=(0,) * ROUNDUP_INTERVALS)
    expandable_segments: bool = False
    per_process_memory_fraction: float | None = None
    source: str = ""

    def divisions_for(self, size: int) -> int:
        """`roundup_power2_divisions(size)`: the slot of ``floor(log2(size))`` from 1 MiB, clamped."""
        index = size.bit_length() - 1 - 20
        if index < 0:
            index = 0
        elif index >= ROUNDUP_INTERVALS:
            index = ROUNDUP_INTERVALS - 1
        return self.roundup_power2_divisions[index]


def tokenize(text: str) -> list[str]:
    tokens: list[str] = []
    buf: list[str] = []
    for ch in text:
        if ch in ",:[]":
            if buf:
                tokens.append("".join(buf))
                buf = []
            tokens.append(ch)
        elif not ch.isspace():
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = tokenize(text)

    def fail(self, message: str) -> AllocatorConfigError:
        return AllocatorConfigError(f"allocator config {self.text!r}: {message}")

    def expect(self, i: int, token: str, after: str) -> None:
        if i >= len(self.tokens) or self.tokens[i] != token:
            got = repr(self.tokens[i]) if i < len(self.tokens) else "the end"
            raise self.fail(f"expected {token!r} after {after!r}, got {got}")

    def value(self, i: int, key: str) -> str:
        if i >= len(self.tokens) or self.tokens[i] in ",:[]":
            raise self.fail(f"expecting a value for {key}")
        return self.tokens[i]

    def integer(self, token: str, key: str, expected: str) -> int:
        # std::stoull accepts a leading integer ("64MB" -> 64); require the whole token instead.
        if not token.isdigit():
            raise self.fail(f"{key} value {token!r} is not a non-negative integer ({expected})")
        return int(token)

    def boolean(self, token: str, key: str) -> bool:
        if token not in ("True", "False"):
            raise self.fail(f"expected a single True/False argument for {key}, got {token!r}")
        return token == "True"


def parse_alloc_conf(text: str | None) -> AllocatorConfig:
    """Parse a `PYTORCH_CUDA_ALLOC_CONF` value; empty or None gives the defaults."""
    if text is None or not text.strip():
        return AllocatorConfig(source=text or "")
    p = _Parser(text)
    tokens = p.tokens
    values: dict[str, object] = {}
    divisions = [0] * ROUNDUP_INTERVALS
    i = 0
    while i < len(tokens):
        key = tokens[i]
        if key in ",:[]":
            raise p.fail(f"expected an option name at token {i}, got {key!r}")
        p.expect(i + 1, ":", key)
        i += 2
        if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            mb = p.integer(p.value(i, key), key, f"megabytes, at least {MIN_SPLIT_MB}")
            if mb < MIN_SPLIT_MB:
                raise p.fail(f"{key} too small, must be >= {MIN_SPLIT_MB}, got {mb}")
            mb = min(mb, SIZE_MAX // MIB)
            values[key] = mb * MIB
        elif key == "garbage_collection_threshold":
            token = p.value(i, key)
            try:
                threshold = float(token)
            except ValueError:
                raise p.fail(f"{key} value {token!r} is not a number in (0.0, 1.0)") from None
            if not 0.0 < threshold < 1.0:
                raise p.fail(f"garbage_collection_threshold is invalid, set it in (0.0, 1.0); got {token}")
            values[key] = threshold
        elif key == "per_process_memory_fraction":
            token = p.value(i, key)
            try:
                fraction = float(token)
            except ValueError:
                raise p.fail(f"{key} value {token!r} is not a number in [0.0, 1.0]") from None
            if not 0.0 <= fraction <= 1.0:
                raise p.fail(f"per_process_memory_fraction is invalid, set it in [0.0, 1.0]; got {token}")
            values[key] = fraction
        elif key == "roundup_power2_divisions":
            i = _parse_divisions(p, i, divisions)
            values[key] = True
        elif key == "expandable_segments":
            values[key] = p.boolean(p.value(i, key), key)
        elif key == "backend":
            backend = p.value(i, key)
            if backend == "cudaMallocAsync":
                raise p.fail("backend cudaMallocAsync is not the caching allocator; "
                             "the simulator models backend:native")
            if backend != "native":
                raise p.fail(f"unknown allocator backend {backend!r}, options are native and cudaMallocAsync")
        elif key in IGNORED_KEYS:
            # Value: a single token (all of these are scalars in PyTorch).
            p.value(i, key)
        else:
            known = ", ".join(MODELLED_KEYS + tuple(sorted(IGNORED_KEYS)))
            raise p.fail(f"unrecognized CachingAllocator option {key!r}; valid options: {known}")
        i += 1
        if i < len(tokens):
            p.expect(i, ",", tokens[i - 1])
            i += 1
            if i == len(tokens):
                raise p.fail("trailing ',' with no option after it")
    return AllocatorConfig(
        max_split_size=values.get("max_split_size_mb", SIZE_MAX),  # type: ignore[arg-type]
        max_non_split_rounding_size=values.get("max_non_split_rounding_mb", LARGE_BUFFER),  # type: ignore[arg-type]
        garbage_collection_threshold=values.get("garbage_collection_threshold", 0.0),  # type: ignore[arg-type]
        roundup_power2_divisions=tuple(divisions),
        expandable_segments=bool(values.get("expandable_segments", False)),
        per_process_memory_fraction=values.get("per_process_memory_fraction"),  # type: ignore[arg-type]
        source=text,
    )


def same_settings(a: AllocatorConfig, b: AllocatorConfig) -> bool:
    """Whether two configs make the allocator behave the same (their source strings aside)."""
    return dataclasses.replace(a, source="") == dataclasses.replace(b, source="")


def format_alloc_conf(config: AllocatorConfig) -> str:
    """A `PYTORCH_CUDA_ALLOC_CONF` string for `config` (its non-default settings); parses back to it."""
    default = AllocatorConfig()
    parts = []
    if config.max_split_size != default.max_split_size:
        parts.append(f"max_split_size_mb:{config.max_split_size // MIB}")
    if config.max_non_split_rounding_size != default.max_non_split_rounding_size:
        parts.append(f"max_non_split_rounding_mb:{config.max_non_split_rounding_size // MIB}")
    if config.garbage_collection_threshold:
        parts.append(f"garbage_collection_threshold:{config.garbage_collection_threshold!r}")
    divisions = config.roundup_power2_divisions
    if any(divisions):
        if len(set(divisions)) == 1:
            parts.append(f"roundup_power2_divisions:{divisions[0]}")
        else:
            slots = ",".join(f"{1 << i}:{n}" for i, n in enumerate(divisions))
            parts.append(f"roundup_power2_divisions:[{slots}]")
    if config.expandable_segments:
        parts.append("expandable_segments:True")
    if config.per_process_memory_fraction is not None:
        parts.append(f"per_process_memory_fraction:{config.per_process_memory_fraction!r}")
    return ",".join(parts)


def _parse_divisions(p: _Parser, i: int, divisions: list[int]) -> int:
    """`roundup_power2_divisions:N` or `[MB:N,...,>:N]`; returns the index of the value's last token."""
    key = "roundup_power2_divisions"
    tokens = p.tokens
    token = p.value(i, key) if i >= len(tokens) or tokens[i] != "[" else "["
    if token != "[":
        n = p.integer(token, key, "a power of two")
        if not _is_power_of_two(n):
            raise p.fail(f"for roundups, the divisions has to be power of 2, got {n}")
        divisions[:] = [n] * ROUNDUP_INTERVALS
        return i
    first_value = True
    last_index = 0
    i += 1
    while i < len(tokens) and tokens[i] != "]":
        bound = tokens[i]
        p.expect(i + 1, ":", bound)
        n = p.integer(p.value(i + 2, key), key, "a power of two or 0")
        if n != 0 and not _is_power_of_two(n):
            raise p.fail(f"for roundups, the divisions has to be power of 2 or 0 to disable roundup, got {n}")
        if bound == ">":
            # Every interval above the last named one (torch 2.11; older releases overwrote it too).
            start = last_index + 1 if not first_value else 0
            divisions[start:] = [n] * (ROUNDUP_INTERVALS - start)
        else:
            mb = p.integer(bound, key, "an interval in megabytes, a power of two, or '>'")
            if not _is_power_of_two(mb):
                raise p.fail(f"for roundups, the intervals have to be power of 2, got {mb}")
            index = min(max(mb.bit_length() - 1, 0), ROUNDUP_INTERVALS - 1)
            if first_value:
                divisions[:index] = [n] * index
                first_value = False
            divisions[index] = n
            last_index = index
        i += 3
        if i < len(tokens) and tokens[i] == ",":
            i += 1
        elif i < len(tokens) and tokens[i] != "]":
            raise p.fail(f"expected ',' or ']' in the roundup_power2_divisions list, got {tokens[i]!r}")
    if i >= len(tokens):
        raise p.fail("roundup_power2_divisions list has no closing ']'")
    return i
