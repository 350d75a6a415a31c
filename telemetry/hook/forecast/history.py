"""The serving process's allocation history, kept bounded, for `/snapshot` (`memtel tune` replays it).

`AllocationHistory` takes every allocation and free the allocator makes, in order (`alloc(key, nbytes)`,
`free(key)`; a key is the block's address, unique while live), and keeps them as ops
``["a", id, nbytes]`` / ``["f", id]`` (telemetry/model/fitsearch/history.py reads them).

Compaction: a serving engine repeats itself (one prefill's launches are the next one's), so the history is
cut into episodes, windows that start with nothing of their own live and end when all they allocated is freed,
freeing nothing older. An episode that repeats the one just before it op for op (the same sizes, the same order
of allocations and frees) is dropped: its first run already left the cached blocks the second reuses. A
repeated allocation and free with nothing between (the smallest episode) is the same rule. What cannot be
compacted (a new size, a free of an older block) is kept, up to `max_ops`; beyond that the history is given up
(`lost` says why; /snapshot serves the segments without it, and `memtel tune` says its answer is then a best
case) rather than kept wrong.

Cost: O(log n) per op (n live allocations), plus the episode's comparison when it ends (its length). Sources: an
allocator source that calls `alloc`/`free` and hands the history to `keep_history` (the program's allocator:
`set_allocator_source`), and on CUDA torch's own recorder (`torch.cuda.memory._record_memory_history`,
started with `start_torch_recording()` where MEMTEL_HOOK_HISTORY=1; its ring is compacted here when
/snapshot is asked, `from_recorded()`, its `empty_cache()` calls kept as ["e"]). The CUDA side's cost per
allocation is not measured yet
(benchmarks/hook_history_gpu.py; docs/lab.md).
"""

from __future__ import annotations

import heapq
import os
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from telemetry import hook_env

MAX_HISTORY_OPS = 2_000_000      # ops kept after compaction (the replay's bound, telemetry/model/fitsearch/history.py)
HISTORY_ENV = hook_env.HOOK_HISTORY
TORCH_MAX_ENTRIES = 4_000_000    # torch's ring of trace entries when the hook records on CUDA


class AllocationHistory:
    """Ops in order, compacted as the module says; thread-safe. An episode is looked for from each of the last
    `candidates` allocations (a block that stays live, a model's weights, does not stop the ones after it): one
    that started at allocation f ends when no allocation from f on is live, unless it freed an older one first."""

    def __init__(self, max_ops: int = MAX_HISTORY_OPS, candidates: int = 64) -> None:
        if max_ops < 1 or candidates < 1:
            raise ValueError(f"max_ops and candidates must be >= 1, got {max_ops}, {candidates}")
        self.max_ops = max_ops
        self.lost: str | None = None
        self.dropped = 0                              # ops compacted away
        self._ops: list[list[int | str]] = []
        self._live: dict[int, int] = {}              # key -> op id
        self._next = 0
        self._open: deque[tuple[int, int]] = deque()   # (first op's position, its id), oldest first
        self._candidates = candidates
        self._newest: list[int] = []                 # live ids, negated (a heap: the newest live id on top)
        self._freed: set[int] = set()                # ids freed but still in the heap
        self._ended: dict[int, tuple[Any, ...]] = {}   # where recent episodes ended -> the signature of the longest
        self._lock = threading.Lock()

    def alloc(self, key: int, nbytes: int) -> None:
        with self._lock:
            if self.lost is not None:
                return
            if key in self._live:   # a key reused before its free: the source skipped a free
                self._give_up("an allocation at an address that is live (a free was not seen)")
                return
            ident = self._next
            self._next += 1
            self._live[key] = ident
            heapq.heappush(self._newest, -ident)
            self._open.append((len(self._ops), ident))
            if len(self._open) > self._candidates:
                self._open.popleft()
            self._ops.append(["a", ident, nbytes])
            self._bound()

    def free(self, key: int) -> None:
        with self._lock:
            if self.lost is not None:
                return
            ident = self._live.pop(key, None)
            if ident is None:
                self._give_up("a free of an address it never saw allocated (recording began late)")
                return
            self._ops.append(["f", ident])
            opened = self._open
            while opened and opened[-1][1] > ident:   # started after this block: they freed an older one
                opened.pop()
            self._freed.add(ident)
            newest = self._newest
            while newest and -newest[0] in self._freed:
                self._freed.discard(-heapq.heappop(newest))
            last_live = -newest[0] if newest else -1
            ended = None
            while opened and opened[-1][1] > last_live:   # nothing from their start on is live: they all end
                ended = opened.pop()
            if ended is not None:
                self._episode_ended(ended[0])
            self._bound()

    def empty_cache(self) -> None:
        """`torch.cuda.empty_cache()`: kept as ["e"]; no episode spans it (the state it leaves is another)."""
        with self._lock:
            if self.lost is not None:
                return
            self._ops.append(["e"])
            self._open.clear()
            self._ended = {}
            self._bound()

    def ops(self) -> list[list[int | str]] | None:
        """A copy of the ops (None once given up)."""
        with self._lock:
            return None if self.lost is not None else [list(op) for op in self._ops]

    def _episode_ended(self, start: int) -> None:
        window = self._ops[start:]
        first = int(window[0][1])
        signature = tuple((op[0], int(op[1]) - first, op[2] if op[0] == "a" else 0) for op in window)
        if self._ended.get(start) == signature:   # the same episode, just before this one
            del self._ops[start:]
            self.dropped += len(window)
            self._ended = {end: sig for end, sig in self._ended.items() if end <= start}
        else:
            self._ended[len(self._ops)] = signature
            if len(self._ended) > self._candidates:
                del self._ended[min(self._ended)]

    def _bound(self) -> None:
        if len(self._ops) > self.max_ops:
            self._give_up(f"over {self.max_ops:,} ops after compaction")

    def _give_up(self, why: str) -> None:
        self.lost = why
        self._ops = []
        self._live = {}
        self._open.clear()
        self._newest = []
        self._freed = set()
        self._ended = {}


_kept: AllocationHistory | None = None


def keep_history(history: AllocationHistory | None) -> None:
    """Serve `history` with /snapshot (a program whose allocator is not CUDA's feeds it: the lab's); None: none."""
    global _kept
    _kept = history


def kept_history() -> AllocationHistory | None:
    return _kept


def from_torch_trace(entries: Iterable[Mapping[str, Any]], max_ops: int = MAX_HISTORY_OPS) -> AllocationHistory:
    """The compacted history of one device's torch trace entries (`_snapshot()["device_traces"][device]`):
    `alloc` and `free_completed` in order (the allocator's trace: telemetry/model/allocsim/trace.py)."""
    history = AllocationHistory(max_ops)
    for entry in entries:
        action = entry.get("action")
        if action == "alloc":
            history.alloc(int(entry["addr"]), int(entry["size"]))
        elif action == "free_completed":
            history.free(int(entry["addr"]))
        if history.lost is not None:
            break
    return history


def recording_asked(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(HISTORY_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def start_torch_recording(torch: Any, max_entries: int = TORCH_MAX_ENTRIES) -> bool:
    """Turn on torch's allocator trace without stacks (the cheapest it records), from now on. False where this
    torch cannot. Call it before the engine allocates (its start): a history that lost its start is refused."""
    record = getattr(getattr(getattr(torch, "cuda", None), "memory", None), "_record_memory_history", None)
    if record is None:
        return False
    try:
        record(enabled="all", context=None, stacks="python", max_entries=max_entries)
    except (TypeError, RuntimeError):
        return False
    return True


def torch_history(torch: Any, device: int, max_ops: int = MAX_HISTORY_OPS) -> tuple[list[Any] | None, str | None]:
    """(the compacted ops of `device`'s trace, why there are none)."""
    try:
        doc = torch.cuda.memory._snapshot()
    except (AttributeError, RuntimeError) as exc:
        return None, f"torch gives no allocation history ({type(exc).__name__})"
    traces = doc.get("device_traces") or []
    if device >= len(traces) or not traces[device]:
        return None, f"no allocation history recorded (set {HISTORY_ENV}=1 before the engine starts)"
    history = from_recorded(doc, device, max_ops)
    return history.ops(), history.lost


def from_recorded(doc: Mapping[str, Any], device: int, max_ops: int = MAX_HISTORY_OPS) -> AllocationHistory:
    """The compacted history of a `torch.cuda.memory._snapshot()` document's device: its allocations and frees, and
    its `empty_cache()` calls read from the device frees no allocation caused, as `memtel whatif` reads them
    (telemetry/model/allocsim/whatif.py `plan_trace`). A trace the replay does not model (several streams,
    private pools, a ring that lost its start) gives a history given up, with why."""
    from telemetry.model.allocsim.config import parse_alloc_conf
    from telemetry.model.allocsim.trace import TraceError, read_trace
    from telemetry.model.allocsim.whatif import OP_ALLOC, OP_EMPTY_CACHE, OP_FREE, plan_trace

    history = AllocationHistory(max_ops)
    try:
        trace = read_trace(doc, device=device, source="the allocator's trace", max_objects=4 * max_ops)
    except TraceError as exc:
        history.lost = str(exc)
        return history
    effective = parse_alloc_conf(trace.effective_conf)
    collects = effective.garbage_collection_threshold > 0 and effective.per_process_memory_fraction is not None
    plan = plan_trace(trace, collects, trace.effective_conf)
    if plan.unknown_frees or plan.unknown_segment_frees:
        history.lost = ("the allocator's trace frees what it never allocated: it lost its start (recording began "
                        f"late, or its ring of {TORCH_MAX_ENTRIES:,} entries wrapped)")
        return history
    for code, addr, size in plan.ops:
        if code == OP_ALLOC:
            history.alloc(addr, size)
        elif code == OP_FREE:
            history.free(addr)
        elif code == OP_EMPTY_CACHE:
            history.empty_cache()
        if history.lost is not None:
            break
    return history


__all__ = ["HISTORY_ENV", "MAX_HISTORY_OPS", "AllocationHistory", "from_recorded", "from_torch_trace", "keep_history",
           "kept_history", "recording_asked", "start_torch_recording", "torch_history"]
