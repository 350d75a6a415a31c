"""The hook's per-call log of one rank as numpy columns in time order, for the report and the demo.

A prefill with a small logits budget makes millions of hooked calls; read as columns (the hook's
`read_call_columns`) they take 8 bytes a value, and a request's window is two binary searches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from telemetry.hook.call_log import NO_ALLOCATOR, CallColumns, CallRecord


@dataclass(frozen=True)
class CallSeries:
    """One rank's calls sorted by (ts, pid, call); `known` is False where a call has no allocator."""

    ts: np.ndarray
    pid: np.ndarray
    reserved_bytes: np.ndarray
    num_device_alloc: np.ndarray

    @classmethod
    def from_columns(cls, columns: CallColumns) -> CallSeries:
        ts = np.frombuffer(columns.ts, dtype=np.float64)
        pid = np.frombuffer(columns.pid, dtype=np.int64)
        call = np.frombuffer(columns.call, dtype=np.int64)
        reserved = np.frombuffer(columns.reserved_bytes, dtype=np.int64)
        device_alloc = np.frombuffer(columns.num_device_alloc, dtype=np.int64)
        if len(ts) > 1 and not bool(np.all(ts[1:] >= ts[:-1])):  # processes of one rank overlapping in time
            order = np.lexsort((call, pid, ts))
            ts, pid, reserved, device_alloc = ts[order], pid[order], reserved[order], device_alloc[order]
        return cls(ts, pid, reserved, device_alloc)

    @classmethod
    def from_records(cls, records: Sequence[CallRecord]) -> CallSeries:
        columns = CallColumns()
        for r in sorted(records, key=lambda r: (r.ts, r.pid, r.call)):
            columns.ts.append(r.ts)
            columns.pid.append(r.pid)
            columns.call.append(r.call)
            columns.reserved_bytes.append(NO_ALLOCATOR if r.allocator is None else r.allocator.reserved_bytes)
            columns.num_device_alloc.append(NO_ALLOCATOR if r.allocator is None else r.allocator.num_device_alloc)
        return cls.from_columns(columns)

    def __len__(self) -> int:
        return len(self.ts)

    @property
    def known(self) -> np.ndarray:
        return self.reserved_bytes != NO_ALLOCATOR

    def since(self, ts: float) -> CallSeries:
        """The calls at or after `ts` (a superseded attempt's calls come before it)."""
        first = int(np.searchsorted(self.ts, ts, side="left"))
        return CallSeries(self.ts[first:], self.pid[first:], self.reserved_bytes[first:], self.num_device_alloc[first:])

    def window(self, started_at: float, ended_at: float) -> tuple[int, int]:
        """Indices [first, end) of the calls with started_at <= ts <= ended_at."""
        return (int(np.searchsorted(self.ts, started_at, side="left")),
                int(np.searchsorted(self.ts, ended_at, side="right")))

    def reserved_points(self, max_points: int = 4000) -> tuple[np.ndarray, np.ndarray]:
        """(call index, reserved bytes) of the calls with an allocator, at most `max_points`: each point the
        largest value of its run of calls, so no peak is lost."""
        index = np.flatnonzero(self.known)
        values = self.reserved_bytes[index]
        if len(values) <= max_points:
            return np.arange(len(values)), values
        step = -(-len(values) // max_points)
        padded = np.concatenate([values, np.full(-len(values) % step, values[-1])])
        return np.arange(0, len(values), step), padded.reshape(-1, step).max(axis=1)


__all__ = ["CallSeries"]
