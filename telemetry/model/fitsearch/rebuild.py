"""An allocator state from a snapshot, rebuilt on a real allocator: what `memtel tune --verify` starts from on CUDA.

The caching allocator gives a fresh process no way to load a state, so it is made by allocating: segment by
segment in address order, a large segment is first allocated whole (one cudaMalloc of its size) and freed, then
its blocks are allocated in order, each split off the free rest; a small segment (2 MiB) is made by its first
block. Every block stays allocated until the end, so no later request reuses an earlier segment's space; then
the blocks the snapshot has free are freed. Private pools' segments are held as one live allocation of their
size each (reserved memory, as the forecast keeps them). `layout()` of the result against the snapshot's tells
whether it worked: a layout torch's rules cannot reach this way (expandable segments, a block kept whole by
`max_split_size`) is reported, not hidden.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from telemetry.errors import RunError
from telemetry.model.allocsim.simulator import SMALL_SIZE
from telemetry.model.allocsim.snapshot import AllocatorState, SnapshotSegment

Layout = tuple[tuple[bool, int, tuple[tuple[int, bool], ...]], ...]


class Allocating(Protocol):
    def alloc(self, nbytes: int) -> object: ...
    def release(self, allocation: object) -> None: ...


def layout(segments: Iterable[SnapshotSegment]) -> Layout:
    """Segments as (small, size, ((block size, live), ...)), sorted: what a rebuild must reproduce (addresses
    aside: the driver picks them)."""
    return tuple(sorted((s.small, s.total_size, tuple((b.size, b.live) for b in s.blocks)) for s in segments))


def rebuild(backend: Allocating, state: AllocatorState) -> list[object]:
    """Allocate `state`'s segments and blocks on `backend` (module docstring); returns the live allocations (keep
    them: dropping one frees its block). RunError for a state this cannot rebuild."""
    if any(s.expandable for s in state.segments):
        raise RunError("the snapshot has expandable segments: a rebuild by allocating cannot lay them out "
                       "(rebuild a state taken under expandable_segments:False)")
    live: list[object] = []
    free_later: list[object] = []
    for segment in sorted(state.segments, key=lambda s: s.address):
        if not segment.small:
            backend.release(backend.alloc(segment.total_size))
        for block in segment.blocks:
            if segment.small and not block.live and block.size > SMALL_SIZE:
                # a free run of a small segment larger than a small request: made of small pieces that merge
                pieces = [SMALL_SIZE] * (block.size // SMALL_SIZE) + [block.size % SMALL_SIZE]
                free_later += [backend.alloc(n) for n in pieces if n]
                continue
            handle = backend.alloc(block.size)
            (live if block.live else free_later).append(handle)
    for private in state.private_segments:
        live.append(backend.alloc(private.total_size))
    for handle in free_later:
        backend.release(handle)
    return live


def compare(expected: AllocatorState, got: AllocatorState) -> str | None:
    """None when `got` (the rebuilt allocator's snapshot) has `expected`'s layout, else the first difference."""
    want, have = layout(expected.segments), layout(got.segments)
    if want == have:
        return None
    for index, (a, b) in enumerate(zip(want, have, strict=False)):
        if a != b:
            return f"segment {index}: snapshot {_segment_text(a)}, rebuilt {_segment_text(b)}"
    return f"{len(want)} segments in the snapshot, {len(have)} rebuilt"


def _segment_text(segment: Any) -> str:
    small, size, blocks = segment
    shown = ", ".join(f"{n}{'' if live else ' free'}" for n, live in blocks[:6])
    return f"{'small' if small else 'large'} {size:,} bytes [{shown}{', ...' if len(blocks) > 6 else ''}]"


__all__ = ["Layout", "compare", "layout", "rebuild"]
