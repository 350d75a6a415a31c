"""The arithmetic of vLLM's sparse-indexer prefill planner, stock and fixed-width.

Pure functions over integers: no torch, no I/O. A request's prefill runs in chunks of `chunk`
tokens; at each chunk step the indexer computes float32 logits `[M, W]` for the chunk's `M` query
rows against the compressed kv so far (`N = tokens_so_far // compress_ratio`). One launch may hold
at most `max_logits_bytes` of logits:

- packed requests join a launch while ``sum(M) * max(sum(N), width) * 4 <= budget`` (stock width
  is ``sum(N)``, so the rule reads ``sum(M) * sum(N) * 4``), and while their kv fits the workspace;
- a request that alone exceeds the budget is split on rows: ``max_rows = max(1, budget_elems // W)``.

Stock width is the chunk's own kv length, so every chunk asks for a larger block and the caching
allocator adds a segment per chunk step. The fix pads every launch to one fixed width,
``max(N, ceil(max_model_len / compress_ratio))``, so every launch has the same shape from the
first chunk on and the allocator reuses its blocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

FLOAT32_BYTES = 4
MIB = 1024 * 1024
DEFAULT_MAX_LOGITS_BYTES = 512 * MIB  # VLLM_SPARSE_INDEXER_MAX_LOGITS_MB default
MODES = ("stock", "fixed")


@dataclass(frozen=True)
class PlannerConfig:
    """Settings of the indexer's planner.

    `mode` is "stock" (width = kv length of the launch) or "fixed" (one width for every launch).
    `fixed_width` overrides ``ceil(max_model_len / compress_ratio)`` in fixed mode.
    `kv_workspace_tokens` bounds ``sum(N)`` of one packed launch (None: unbounded).
    """

    mode: str = "stock"
    chunk: int = 8192
    compress_ratio: int = 4
    max_model_len: int = 409_600
    max_logits_bytes: int = DEFAULT_MAX_LOGITS_BYTES
    fixed_width: int | None = None
    kv_workspace_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"planner mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        for name in ("chunk", "compress_ratio", "max_model_len", "max_logits_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"planner {name} must be a positive integer, got {value!r}")
        if self.max_logits_bytes < FLOAT32_BYTES:
            raise ValueError(f"planner max_logits_bytes must be at least {FLOAT32_BYTES}, got {self.max_logits_bytes}")
        if self.fixed_width is not None and (not isinstance(self.fixed_width, int) or self.fixed_width < 1):
            raise ValueError(f"planner fixed_width must be a positive integer or None, got {self.fixed_width!r}")
        if self.kv_workspace_tokens is not None and self.kv_workspace_tokens < 1:
            raise ValueError(f"planner kv_workspace_tokens must be positive or None, got {self.kv_workspace_tokens!r}")

    @property
    def budget_elems(self) -> int:
        return self.max_logits_bytes // FLOAT32_BYTES

    @property
    def padded_width(self) -> int:
        """The fixed arm's width floor: ``ceil(max_model_len / compress_ratio)`` unless overridden."""
        if self.fixed_width is not None:
            return self.fixed_width
        return math.ceil(self.max_model_len / self.compress_ratio)


@dataclass(frozen=True)
class Launch:
    """One logits launch: float32 ``[rows, width]``, of which ``[rows, kv_len]`` is computed."""

    rows: int
    width: int
    kv_len: int
    requests: tuple[int, ...] = (0,)

    @property
    def nbytes(self) -> int:
        return self.rows * self.width * FLOAT32_BYTES

    @property
    def computed_bytes(self) -> int:
        return self.rows * self.kv_len * FLOAT32_BYTES


@dataclass(frozen=True)
class ChunkStep:
    """One prefill chunk of one request: rows ``[start, start + rows)``; ``kv_len`` after it."""

    index: int
    start: int
    rows: int
    tokens_so_far: int
    kv_len: int


def kv_length(tokens_so_far: int, compress_ratio: int) -> int:
    return tokens_so_far // compress_ratio


def launch_width(kv_len: int, config: PlannerConfig) -> int:
    """Width of a launch whose computed part is `kv_len` columns."""
    if config.mode == "stock":
        return kv_len
    return max(kv_len, config.padded_width)


def chunk_steps(tokens: int, chunk: int, compress_ratio: int, *, start_token: int = 0) -> list[ChunkStep]:
    """The chunk steps of one prefill of `tokens` new tokens after `start_token` cached ones."""
    if tokens < 0 or chunk < 1 or compress_ratio < 1 or start_token < 0:
        raise ValueError(
            f"chunk_steps needs tokens >= 0, chunk >= 1, compress_ratio >= 1, start_token >= 0; "
            f"got tokens={tokens}, chunk={chunk}, compress_ratio={compress_ratio}, start_token={start_token}"
        )
    steps = []
    done = 0
    while done < tokens:
        rows = min(chunk, tokens - done)
        so_far = start_token + done + rows
        steps.append(ChunkStep(len(steps), start_token + done, rows, so_far, kv_length(so_far, compress_ratio)))
        done += rows
    return steps


def split_rows(rows: int, kv_len: int, config: PlannerConfig, request: int = 0) -> list[Launch]:
    """Launches for one request alone: whole if it fits the budget, else sub-chunked on rows."""
    width = launch_width(kv_len, config)
    if rows * width * FLOAT32_BYTES <= config.max_logits_bytes:
        return [Launch(rows, width, kv_len, (request,))]
    max_rows = max(1, config.budget_elems // max(width, 1))
    launches = []
    for first in range(0, rows, max_rows):
        launches.append(Launch(min(max_rows, rows - first), width, kv_len, (request,)))
    return launches


def plan_launches(requests: Sequence[tuple[int, int]], config: PlannerConfig) -> list[Launch]:
    """Pack requests ``(rows M, kv length N)`` into launches, in order, as the indexer does.

    A request joins the open launch while ``sum(M) * max(sum(N), width floor) * 4 <= budget``
    (stock: ``sum(M) * sum(N) * 4``) and the kv workspace holds ``sum(N)``; a request that does
    not fit even alone is sub-chunked on rows.
    """
    launches: list[Launch] = []
    group: list[int] = []
    sum_rows = sum_kv = 0

    def close() -> None:
        if group:
            launches.append(Launch(sum_rows, launch_width(sum_kv, config), sum_kv, tuple(group)))

    for index, (rows, kv_len) in enumerate(requests):
        if rows < 1 or kv_len < 0:
            raise ValueError(f"request {index}: rows must be >= 1 and kv length >= 0, got ({rows}, {kv_len})")
        alone_fits = rows * launch_width(kv_len, config) * FLOAT32_BYTES <= config.max_logits_bytes
        if not alone_fits:
            close()
            group, sum_rows, sum_kv = [], 0, 0
            launches.extend(split_rows(rows, kv_len, config, index))
            continue
        new_rows, new_kv = sum_rows + rows, sum_kv + kv_len
        fits = new_rows * launch_width(new_kv, config) * FLOAT32_BYTES <= config.max_logits_bytes
        if config.kv_workspace_tokens is not None:
            fits = fits and new_kv <= config.kv_workspace_tokens
        if group and not fits:
            close()
            group, sum_rows, sum_kv = [], 0, 0
            new_rows, new_kv = rows, kv_len
        group.append(index)
        sum_rows, sum_kv = new_rows, new_kv
    close()
    return launches


def plan_prefill(tokens: int, config: PlannerConfig, *, start_token: int = 0) -> list[tuple[ChunkStep, list[Launch]]]:
    """One request's prefill: each chunk step with its logits launches (the same for every layer)."""
    return [
        (step, split_rows(step.rows, step.kv_len, config))
        for step in chunk_steps(tokens, config.chunk, config.compress_ratio, start_token=start_token)
    ]


def iter_launches(tokens: int, config: PlannerConfig, layers: int) -> Iterator[tuple[ChunkStep, int, Launch]]:
    """Every launch of a prefill in execution order: chunk step, then layer, then launch."""
    for step, launches in plan_prefill(tokens, config):
        for layer in range(layers):
            for launch in launches:
                yield step, layer, launch
