"""The one launch loop: a prefill's logits launches, chunk step by chunk step, layer by layer.

`run_prefill` is what `memtel replay`, the demo's prediction, the truth capture and every rank of
the lab server run, on any `LaunchBackend`. Per chunk step the planner gives the launches; for every
layer each launch allocates its logits (through `indexer_logits_launch`), then its top-k outputs and a
transient if the shape and pattern ask for them, which are freed at once. With `keep_previous` (the
default, as in a pipeline) a launch's logits stay alive until the next launch has allocated, across
layers and chunk steps; the last one is freed before the last chunk step ends.

An observer sees the loop: the start and end of every chunk step, every launch, and every op in the
allocator-truth format (``["malloc", id, nbytes]`` / ``["free", id]``, ids from 0 per prefill).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from telemetry.model.indexer.backends import LaunchBackend
from telemetry.model.indexer.planner import ChunkStep, Launch, Mode, plan_prefill
from telemetry.model.indexer.shape import FLOAT32_BYTES, IndexerShape

INT64_BYTES = 8
Op = list[object]  # ["malloc", id, nbytes] or ["free", id]: one op of the allocator-truth format


@dataclass(frozen=True)
class LaunchPattern:
    """What the loop does beyond the planner's launches (the defaults are the lab server's).

    keep_previous: a launch's logits stay alive while the next launch allocates.
    transient_bytes: one more allocation of this size per launch, freed after the launch.
    row_scale: multiplies every launch's rows (at least one row), so its bytes: the lab's `--scale`.
    """

    keep_previous: bool = True
    transient_bytes: int = 0
    row_scale: float = 1.0

    def __post_init__(self) -> None:
        from telemetry.model.indexer.shape import ShapeError

        if self.transient_bytes < 0:
            raise ShapeError(f"transient_bytes must be >= 0, got {self.transient_bytes}")
        if not 0 < self.row_scale <= 1:
            raise ShapeError(f"row_scale must be in (0, 1], got {self.row_scale}")

    def rows(self, rows: int) -> int:
        """Rows of a launch after `row_scale` (a scaled launch keeps at least one row)."""
        return rows if self.row_scale == 1.0 else max(1, math.ceil(rows * self.row_scale))


class PrefillObserver:
    """The loop's events; every method does nothing unless overridden."""

    def step_started(self, step: ChunkStep, launches: list[Launch]) -> None:
        """A chunk step begins (`launches`: one layer's)."""

    def launch_started(self, step: ChunkStep, layer: int, index: int) -> None:
        """The `index`-th launch of `layer` is about to allocate its logits."""

    def op_done(self, op: Op) -> None:
        """An allocation or a free has happened."""

    def step_ended(self, step: ChunkStep, launches: list[Launch]) -> None:
        """A chunk step is done (after the last one, nothing of the prefill is alive any more)."""


@dataclass(frozen=True)
class PrefillDone:
    launches: int
    chunk_steps: int


def run_prefill(backend: LaunchBackend, shape: IndexerShape, mode: Mode, tokens: int, *, start_token: int = 0,
                pattern: LaunchPattern = LaunchPattern(), observer: PrefillObserver | None = None) -> PrefillDone:
    """Make every launch of one request's prefill of `tokens` new tokens after `start_token` cached ones."""
    watch = observer or PrefillObserver()
    plan = plan_prefill(tokens, shape, mode, start_token=start_token)
    live: dict[int, object] = {}
    next_id = 0
    previous: int | None = None
    launches = 0

    def record(allocation: object, nbytes: int) -> int:
        nonlocal next_id
        ident, next_id = next_id, next_id + 1
        live[ident] = allocation
        watch.op_done(["malloc", ident, nbytes])
        return ident

    def alloc(nbytes: int) -> int:
        return record(backend.alloc(nbytes), nbytes)

    def free(ident: int) -> None:
        backend.release(live.pop(ident))
        watch.op_done(["free", ident])

    try:
        for position, (step, step_launches) in enumerate(plan):
            watch.step_started(step, step_launches)
            for layer in range(shape.layers):
                for index, launch in enumerate(step_launches):
                    watch.launch_started(step, layer, index)
                    rows = pattern.rows(launch.rows)
                    logits = record(backend.launch(rows, launch.width, launch.kv_len),
                                    rows * launch.width * FLOAT32_BYTES)
                    extras = []
                    if shape.topk:
                        extras.append(alloc(rows * shape.topk * FLOAT32_BYTES))  # top-k values
                        extras.append(alloc(rows * shape.topk * INT64_BYTES))  # top-k indices
                    if pattern.transient_bytes:
                        extras.append(alloc(pattern.transient_bytes))
                    for ident in reversed(extras):
                        free(ident)
                    if pattern.keep_previous:
                        if previous is not None:
                            free(previous)
                        previous = logits
                    else:
                        free(logits)
                    launches += 1
            if position == len(plan) - 1 and previous is not None:
                free(previous)
                previous = None
            watch.step_ended(step, step_launches)
    except BaseException:
        # A failed launch (out of memory) ends the prefill: what it still holds goes back to the allocator, as a
        # failed step's tensors do when its exception unwinds.
        for allocation in live.values():
            try:
                backend.release(allocation)
            except Exception:
                pass
        live.clear()
        raise
    return PrefillDone(launches, len(plan))


__all__ = ["LaunchPattern", "Op", "PrefillDone", "PrefillObserver", "run_prefill"]
