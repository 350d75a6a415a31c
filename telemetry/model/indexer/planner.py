"""The arithmetic of vLLM's sparse-indexer prefill planner, in its two width modes.

Pure functions over integers: no torch, no I/O. A request's prefill runs in chunks of `shape.chunk`
tokens; at each chunk step the indexer computes float32 logits `[M, W]` for the chunk's `M` query
rows against the compressed kv so far (`N = tokens_so_far // compress_ratio`). One launch may hold
at most `shape.logits_budget_bytes` of logits:

- packed requests join a launch while ``sum(M) * max(sum(N), width) * 4 <= budget`` (stock width
  is ``sum(N)``, so the rule reads ``sum(M) * sum(N) * 4``), and while their kv fits the workspace;
- a request that alone exceeds the budget is split on rows: ``max_rows = max(1, budget_elems // W)``.

The width mode says how wide a launch is. `stock`: the chunk's own kv length, so every chunk asks for
a larger block and the caching allocator adds a segment per chunk step. `fixed` (the fix): one padded
width for every launch, ``max(N, shape.padded_width)``, so every launch has the same shape from the
first chunk on and the allocator reuses its blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from telemetry.model.indexer.shape import FLOAT32_BYTES, IndexerShape, ShapeError

Mode = Literal["stock", "fixed"]
MODES: tuple[Mode, ...] = ("stock", "fixed")


def check_mode(mode: str) -> Mode:
    """`mode` if it is a width mode; ShapeError naming the valid ones otherwise."""
    if mode not in MODES:
        raise ShapeError(f"width mode must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


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
    def computed_elements(self) -> int:
        """Logits elements the kernel computes (the padding is allocated, not computed)."""
        return self.rows * self.kv_len


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


def launch_width(kv_len: int, shape: IndexerShape, mode: Mode) -> int:
    """Width of a launch whose computed part is `kv_len` columns."""
    if check_mode(mode) == "stock":
        return kv_len
    return max(kv_len, shape.padded_width)


def chunk_steps(tokens: int, chunk: int, compress_ratio: int, *, start_token: int = 0) -> list[ChunkStep]:
    """The chunk steps of one prefill of `tokens` new tokens after `start_token` cached ones."""
    if tokens < 0 or chunk < 1 or compress_ratio < 1 or start_token < 0:
        raise ShapeError(
            f"chunk_steps needs tokens >= 0, chunk >= 1, compress_ratio >= 1, start_token >= 0; "
            f"got tokens={tokens}, chunk={chunk}, compress_ratio={compress_ratio}, start_token={start_token}"
        )
    steps: list[ChunkStep] = []
    done = 0
    while done < tokens:
        rows = min(chunk, tokens - done)
        so_far = start_token + done + rows
        steps.append(ChunkStep(len(steps), start_token + done, rows, so_far, kv_length(so_far, compress_ratio)))
        done += rows
    return steps


def split_rows(rows: int, kv_len: int, shape: IndexerShape, mode: Mode, request: int = 0) -> list[Launch]:
    """Launches for one request alone: whole if it fits the budget, else sub-chunked on rows."""
    width = launch_width(kv_len, shape, mode)
    if rows * width * FLOAT32_BYTES <= shape.logits_budget_bytes:
        return [Launch(rows, width, kv_len, (request,))]
    max_rows = max(1, shape.budget_elems // max(width, 1))
    return [Launch(min(max_rows, rows - first), width, kv_len, (request,)) for first in range(0, rows, max_rows)]


def plan_launches(requests: Sequence[tuple[int, int]], shape: IndexerShape, mode: Mode, *,
                  kv_workspace_tokens: int | None = None) -> list[Launch]:
    """Pack requests ``(rows M, kv length N)`` into launches, in order, as the indexer does.

    A request joins the open launch while ``sum(M) * max(sum(N), width floor) * 4 <= budget``
    (stock: ``sum(M) * sum(N) * 4``) and the kv workspace (`kv_workspace_tokens`, None: unbounded)
    holds ``sum(N)``; a request that does not fit even alone is sub-chunked on rows.
    """
    if kv_workspace_tokens is not None and kv_workspace_tokens < 1:
        raise ShapeError(f"kv_workspace_tokens must be positive or None, got {kv_workspace_tokens!r}")
    budget = shape.logits_budget_bytes
    launches: list[Launch] = []
    group: list[int] = []
    sum_rows = sum_kv = 0

    def close() -> None:
        if group:
            launches.append(Launch(sum_rows, launch_width(sum_kv, shape, mode), sum_kv, tuple(group)))

    for index, (rows, kv_len) in enumerate(requests):
        if rows < 1 or kv_len < 0:
            raise ShapeError(f"request {index}: rows must be >= 1 and kv length >= 0, got ({rows}, {kv_len})")
        if rows * launch_width(kv_len, shape, mode) * FLOAT32_BYTES > budget:
            close()
            group, sum_rows, sum_kv = [], 0, 0
            launches.extend(split_rows(rows, kv_len, shape, mode, index))
            continue
        new_rows, new_kv = sum_rows + rows, sum_kv + kv_len
        fits = new_rows * launch_width(new_kv, shape, mode) * FLOAT32_BYTES <= budget
        if kv_workspace_tokens is not None:
            fits = fits and new_kv <= kv_workspace_tokens
        if group and not fits:
            close()
            group, sum_rows, sum_kv = [], 0, 0
            new_rows, new_kv = rows, kv_len
        group.append(index)
        sum_rows, sum_kv = new_rows, new_kv
    close()
    return launches


def launch_count(tokens: int, shape: IndexerShape, mode: Mode, *, limit: int | None = None) -> int:
    """How many launches `plan_prefill(tokens, shape, mode)` makes per layer, without building the plan.

    limit: stop counting once the count passes it (a bound is all a caller needs; cheap for any input).
    """
    check_mode(mode)
    count = 0
    done = 0
    while done < tokens:
        rows = min(shape.chunk, tokens - done)
        done += rows
        width = launch_width(kv_length(done, shape.compress_ratio), shape, mode)
        if rows * width * FLOAT32_BYTES <= shape.logits_budget_bytes:
            count += 1
        else:
            max_rows = max(1, shape.budget_elems // max(width, 1))
            count += -(-rows // max_rows)
        if limit is not None and count > limit:
            break
    return count


PrefillPlan = list[tuple[ChunkStep, list[Launch]]]


def plan_prefill(tokens: int, shape: IndexerShape, mode: Mode, *, start_token: int = 0) -> PrefillPlan:
    """One request's prefill: each chunk step with its logits launches (the same for every layer)."""
    check_mode(mode)
    return [
        (step, split_rows(step.rows, step.kv_len, shape, mode))
        for step in chunk_steps(tokens, shape.chunk, shape.compress_ratio, start_token=start_token)
    ]
