"""Unified-memory emulation: back each simulated device segment with real host pages.

On a DGX Spark or Grace Hopper box, memory the CUDA caching allocator maps comes out of the host's
RAM, so `MemAvailable` falls by each new segment and rises only when a segment is released. With
the allocator simulator there is no device; this module gives every simulated segment an anonymous
private mapping, touches all of its pages (an untouched mapping costs the host nothing) and unmaps
it when the simulator releases the segment. The host's real `MemAvailable`, as the node daemon and
the hook read it, then moves the way it would on such a box.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading

from telemetry.errors import RunError

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class HostBackingError(RunError, MemoryError):
    """The host could not give a simulated segment its pages."""


class HostBacking:
    """Host pages for segments: `map(segment_id, nbytes)` / `unmap(segment_id, nbytes)`.

    The two methods have the signature of the simulator's `on_segment_map` / `on_segment_unmap`.
    A segment may be mapped in several calls and released in parts (expandable segments map and
    unmap pages of one segment), so each segment keeps a stack of mappings and an unmap of `nbytes`
    releases that many bytes from its end; `nbytes=None` releases the whole segment.
    """

    def __init__(self) -> None:
        self._segments: dict[object, list[list[int]]] = {}
        self._lock = threading.Lock()
        self.mapped_bytes = 0
        self.peak_bytes = 0

    def map(self, segment_id: object, nbytes: int) -> None:
        if nbytes <= 0:
            return
        address = _libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                             -1, 0)
        if address in (None, _MAP_FAILED):
            errno = ctypes.get_errno()
            raise HostBackingError(f"mmap of {nbytes} bytes for segment {segment_id!r} failed: {os.strerror(errno)}")
        # Writing every page commits it, as cudaMalloc commits memory on a unified-memory box.
        ctypes.memset(address, 1, nbytes)
        with self._lock:
            self._segments.setdefault(segment_id, []).append([address, nbytes])
            self.mapped_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.mapped_bytes)

    def unmap(self, segment_id: object, nbytes: int | None = None) -> None:
        releases: list[tuple[int, int]] = []
        with self._lock:
            stack = self._segments.get(segment_id)
            if not stack:
                return
            left = sum(size for _, size in stack) if nbytes is None else nbytes
            while stack and left > 0:
                address, size = stack[-1]
                if size <= left:
                    stack.pop()
                    releases.append((address, size))
                    left -= size
                else:  # release the tail of this mapping (sizes are page multiples)
                    keep = size - left
                    stack[-1][1] = keep
                    releases.append((address + keep, left))
                    left = 0
            if not stack:
                del self._segments[segment_id]
            self.mapped_bytes -= sum(size for _, size in releases)
        for address, size in releases:
            _libc.munmap(address, size)  # the pages go back to the kernel at once

    def release_all(self) -> None:
        for segment_id in list(self._segments):
            self.unmap(segment_id)

    def __len__(self) -> int:
        return len(self._segments)


def parse_percpu_pagesets(zoneinfo_text: str, page_size: int = mmap.PAGESIZE) -> dict[str, int] | None:
    """Bytes on the per-CPU free page lists now (`count`), their current limit (`high`) and the most
    they may hold (`high_max`), summed over CPUs and zones, from /proc/zoneinfo.

    Recent kernels (6.7+, PCP high auto-tuning) park freed pages on these lists, and neither MemFree
    nor MemAvailable counts them: a release shows up in MemAvailable late, and a new mapping can be
    served from them without MemAvailable moving. None when the file has no pagesets.
    """
    totals = {"count": 0, "high": 0, "high_max": 0}
    found = False
    in_pagesets = False
    for line in zoneinfo_text.splitlines():
        stripped = line.strip()
        if stripped.startswith("pagesets"):
            in_pagesets = True
            continue
        if in_pagesets and stripped.startswith(("count:", "high:", "high_max:")):
            name, _, value = stripped.partition(":")
            try:
                totals[name] += int(value.split()[0])
            except (ValueError, IndexError):
                continue
            found = True
        elif in_pagesets and stripped.startswith("Node "):
            in_pagesets = False
    if not found:
        return None
    return {f"{name}_bytes": pages * page_size for name, pages in totals.items()}


def read_percpu_pagesets(path: str = "/proc/zoneinfo") -> dict[str, int] | None:
    try:
        with open(path) as f:
            return parse_percpu_pagesets(f.read())
    except OSError:
        return None
