"""The longest prefill that fits: the largest N such that a cold prefill of N tokens, and of every shorter
length, runs on the allocator simulator (seeded with a live state) without running out of a memory limit.

`max_prefill_tokens(state, shape, limit_bytes=...)` searches the simulator, not a formula. A prefill of M
tokens, M = k·chunk + r (0 < r <= chunk), makes exactly the allocator calls of the first k chunk steps of any
longer prefill, then one last step of r rows; so:

1. One simulated prefill of the longest length (`max_tokens`, the engine's max-model-len) answers every chunk
   boundary: the prefill of (k+1)·chunk tokens fits if and only if the long one got through step k (its last
   logits are freed at the end instead of after the next launch: nothing more is allocated). The long
   prefill's out-of-memory step f is the first boundary that does not fit.
2. Inside a step, the last chunk's launches grow with r, but not monotonically in what the allocator does with
   them: a short last chunk can fall into the small pool (requests up to 1 MiB, 2 MiB segments) or the 20 MiB
   buffers (up to 10 MiB) where the full chunk reuses a large cached block, and the number of launches a step
   splits into changes with r. So each step k <= f is cut into classes of r in which every allocation of the
   last step stays in one allocator class (its pool, its segment size rule, whether it is oversize under
   `max_split_size`) and the launch count is fixed; within a class the sizes only grow with r. The largest r
   of each class is simulated (a class's top; the step's own top is the boundary of 1.). Where a top does not
   fit, a binary search inside that class finds its first length that does not.

The answer is exact at every length the search simulated; between them it rests on the allocator needing no
less for a larger request of the same class. tests/indexer/test_fit.py checks it against simulating every
length on small shapes under several allocator settings.

The limit is what the simulated allocator may reserve in all (`capacity_bytes`): its cache is freed and the
call retried before it runs out, as the real allocator does when the limit is its own (the device, a memory
fraction, a node it has alone). Where the limit is a share of a node that other ranks also fill
(`release_cache_on_oom=False`), a prefill fits only if the allocator never reserves beyond it. A memory
fraction in the allocator settings applies as in the process, against `total_memory`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from telemetry.errors import ConfigError
from telemetry.model.allocsim.config import AllocatorConfig, parse_alloc_conf
from telemetry.model.allocsim.simulator import (
    LARGE_BUFFER,
    MIN_LARGE_ALLOC,
    SMALL_BUFFER,
    SMALL_SIZE,
    allocation_size,
    round_size,
)
from telemetry.model.allocsim.snapshot import AllocatorState
from telemetry.model.indexer.forecast import simulate_prefill
from telemetry.model.indexer.planner import Mode, check_mode, kv_length, split_rows
from telemetry.model.indexer.prefill import LaunchPattern
from telemetry.model.indexer.shape import FLOAT32_BYTES, IndexerShape


@dataclass(frozen=True)
class MaxFit:
    """The answer of `max_prefill_tokens`.

    tokens: the largest N <= max_tokens such that every length 1..N fits (0: not even one token does).
    max_tokens: the longest length searched (the engine's max-model-len).
    limit_bytes: what the simulated allocator could reserve in all; start_reserved_bytes: at the state.
    peak_reserved_bytes: the simulated peak reserved of a prefill of `tokens` (the state's reserved for 0).
    first_misfit: `tokens` + 1 when that is at most max_tokens (it runs out of memory), else None.
    simulations: simulated prefills the search ran.
    """

    tokens: int
    max_tokens: int
    limit_bytes: int
    start_reserved_bytes: int
    peak_reserved_bytes: int
    first_misfit: int | None
    simulations: int

    def as_json(self) -> dict[str, Any]:
        return dict(vars(self))


def max_prefill_tokens(state: AllocatorState, shape: IndexerShape, *, limit_bytes: int, max_tokens: int | None = None,
                       mode: Mode = "stock", alloc_conf: str | None = None, pattern: LaunchPattern | None = None,
                       total_memory: int | None = None, pause: Callable[[], None] | None = None,
                       release_cache_on_oom: bool = True) -> MaxFit:
    """The longest prefill that fits within `limit_bytes` of reserved memory (see the module).

    max_tokens: the longest length to consider (None: the shape's max_model_len).
    release_cache_on_oom: False where the limit is a share of memory that the allocator does not see (ranks that
    share one node): a prefill fits only if its allocator never reserves beyond the limit, even with cached
    blocks it could have freed (another rank may fill the node first, and each allocator frees its cache only
    when the node is full).
    The other arguments are `forecast()`'s. Raises ConfigError for a state or setting the simulator cannot start
    from, or a bad limit.
    """
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes < 0:
        raise ConfigError(f"the fit limit must be a non-negative number of bytes, got {limit_bytes!r}")
    top = shape.max_model_len if max_tokens is None else max_tokens
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ConfigError(f"max_tokens must be a non-negative integer, got {top!r}")
    mode = check_mode(mode)
    launch_pattern = pattern or LaunchPattern()
    conf = parse_alloc_conf(alloc_conf if alloc_conf is not None else (state.alloc_conf or ""))
    start = state.counters.reserved_bytes
    runs = 0

    def run(tokens: int) -> tuple[Any, Any]:
        nonlocal runs
        runs += 1
        return simulate_prefill(state, shape, tokens, mode=mode, alloc_conf=alloc_conf, pattern=launch_pattern,
                                capacity_bytes=limit_bytes, total_memory=total_memory, pause=pause,
                                release_cache_on_oom=release_cache_on_oom)

    def answer(tokens: int, peak: int) -> MaxFit:
        return MaxFit(tokens, top, limit_bytes, start, peak, tokens + 1 if tokens < top else None, runs)

    if top == 0:
        return answer(0, start)
    longest, watch = run(top)
    failed_step = None if not longest.out_of_memory else max(watch.step, 0)
    chunk = shape.chunk
    last_step = (top - 1) // chunk
    for step in range(0, last_step + 1 if failed_step is None else failed_step + 1):
        base = step * chunk
        rows = min(chunk, top - base)
        boundary_fits = failed_step is None or step < failed_step
        fit_peak = watch.step_peaks[step - 1] if step else start   # the peak of the last length known to fit
        if boundary_fits and watch.step_reserved[step] + _most_growth(shape, mode, launch_pattern, conf, base,
                                                                      rows) <= limit_bytes:
            continue   # no last chunk of this step can reach the limit, whatever the allocator does
        for low, high in _classes(shape, mode, launch_pattern, conf, base, rows):
            if high == rows and boundary_fits:
                continue   # the step's own top: answered by the long prefill
            if high < rows:
                probe, _ = run(base + high)
                if not probe.out_of_memory:
                    fit_peak = probe.peak_reserved_bytes
                    continue
            # The first length of this class that does not fit; every length before the class fits.
            good, bad = low - 1, high
            while bad - good > 1:
                middle = (good + bad) // 2
                probe, _ = run(base + middle)
                if probe.out_of_memory:
                    bad = middle
                else:
                    good, fit_peak = middle, probe.peak_reserved_bytes
            return answer(base + good, fit_peak)
    return answer(top, longest.peak_reserved_bytes)


def _allocation_class(nbytes: int, conf: AllocatorConfig) -> tuple[int, ...]:
    """What the allocator does differently by size: none (0 bytes), the small pool, the 20 MiB buffers, a
    segment of the request's own size; oversize under max_split_size; under expandable segments the pool alone."""
    if nbytes == 0:
        return (0,)
    size = round_size(nbytes, conf)
    if size <= SMALL_SIZE:
        return (1,)
    oversize = int(size >= conf.max_split_size)
    if conf.expandable_segments:
        return (2, oversize)
    return (3 if size < MIN_LARGE_ALLOC else 4, oversize)


def _last_step_sizes(shape: IndexerShape, mode: Mode, pattern: LaunchPattern, base: int, rows: int) -> list[int]:
    """The bytes of every allocation one layer makes in a last chunk step of `rows` rows after `base` tokens."""
    kv = kv_length(base + rows, shape.compress_ratio)
    sizes = []
    for launch in split_rows(rows, kv, shape, mode):
        scaled = pattern.rows(launch.rows)
        sizes.append(scaled * launch.width * FLOAT32_BYTES)
        if shape.topk:
            sizes += [scaled * shape.topk * FLOAT32_BYTES, scaled * shape.topk * 8]
        if pattern.transient_bytes:
            sizes.append(pattern.transient_bytes)
    return sizes


def _last_step_key(shape: IndexerShape, mode: Mode, pattern: LaunchPattern, conf: AllocatorConfig, base: int,
                   rows: int) -> tuple[tuple[int, ...], ...]:
    """The allocator classes the allocations of a last chunk step of `rows` rows fall in (as a sorted set: more
    launches of the same classes, each no larger, stay in the class)."""
    return tuple(sorted({_allocation_class(n, conf) for n in _last_step_sizes(shape, mode, pattern, base, rows)}))


def _most_growth(shape: IndexerShape, mode: Mode, pattern: LaunchPattern, conf: AllocatorConfig, base: int,
                 rows: int) -> int:
    """An upper bound of what any last chunk step of at most `rows` rows can add to reserved: every allocation of
    every layer in a new segment (its allocation size; under expandable segments its bytes rounded up to a page,
    plus a page). The sizes grow with the rows, so the step's full rows bound every shorter last chunk."""
    total = 0
    for n in _last_step_sizes(shape, mode, pattern, base, rows):
        size = round_size(n, conf) if n else 0
        if not size:
            continue
        if conf.expandable_segments:
            page = SMALL_BUFFER if size <= SMALL_SIZE else LARGE_BUFFER
            total += -(-size // page) * page + page
        else:
            total += allocation_size(size)
    return total * shape.layers


def _classes(shape: IndexerShape, mode: Mode, pattern: LaunchPattern, conf: AllocatorConfig, base: int,
             rows: int) -> list[tuple[int, int]]:
    """The step's last-chunk lengths 1..rows cut into runs of one allocator class: [(first, last), ...]."""
    def key(r: int) -> tuple[tuple[int, ...], ...]:
        return _last_step_key(shape, mode, pattern, conf, base, r)

    cuts: list[tuple[int, int]] = []
    first = 1
    while first <= rows:
        first_key = key(first)
        if key(rows) == first_key:
            cuts.append((first, rows))
            break
        low, high = first, rows   # key(low) == first_key != key(high): find the last r of this run
        while high - low > 1:
            middle = (low + high) // 2
            if key(middle) == first_key:
                low = middle
            else:
                high = middle
        cuts.append((first, low))
        first = low + 1
    return cuts


__all__ = ["MaxFit", "max_prefill_tokens"]
