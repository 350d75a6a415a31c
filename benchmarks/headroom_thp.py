"""What a large-page allocation really gets, next to what each headroom definition said (issue 20, part 1).

    sudo .venv/bin/python -m benchmarks.headroom_thp --cache-dir /var/tmp/memtel-thp [--cache-gib 28]

Three states of the node, in this order:
1. page cache full: files larger than memory read through the page cache (`--cache-gib`, written once);
2. page cache dropped (`echo 3 > /proc/sys/vm/drop_caches`);
3. fragmented on purpose: a region of small pages is touched, one 4 KiB page of every 2 MiB of it is locked
   (mlock) and the rest freed, so free memory lies between pinned pages; with
   `/proc/sys/vm/compact_unevictable_allowed` 0 (restored afterwards) compaction may not move the pinned
   pages, so those 2 MiB blocks cannot be rebuilt. The run also does it with compaction allowed to move them.

In each state it reads the headroom figures (the collector's code) and then, in a child process capped with
RLIMIT_AS, maps `min(MemAvailable - --keep-free-gib, --max-gib)` of anonymous memory with MADV_HUGEPAGE and
touches one byte per 2 MiB: a fault gets a transparent huge page when the kernel can find or make a free
2 MiB block (defrag `madvise`: direct reclaim and compaction), else one small page. AnonHugePages of the
child is what the allocation got in large blocks. Needs root (drop_caches, the sysctl) and THP `madvise` or
`always`. Everything started is stopped; the cache files are kept for the next run unless --remove-files.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.machine import machine
from telemetry.procfs.buddyinfo import CONTIGUOUS_BLOCK_BYTES, free_bytes_in_blocks_of_at_least, parse_buddyinfo
from telemetry.procfs.headroom import (
    FaultWindow,
    headroom_without_reclaim,
    read_thp_mode,
    thp_faults_compact,
    unified_headroom,
)
from telemetry.procfs.meminfo import parse_meminfo
from telemetry.procfs.vmstat import parse_vmstat

GIB = 1 << 30
HUGE = 2 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
UNEVICTABLE_SYSCTL = Path("/proc/sys/vm/compact_unevictable_allowed")


def snapshot(window: FaultWindow) -> dict[str, float]:
    meminfo = parse_meminfo(Path("/proc/meminfo").read_text())
    vmstat = parse_vmstat(Path("/proc/vmstat").read_text())
    contiguous = free_bytes_in_blocks_of_at_least(parse_buddyinfo(Path("/proc/buddyinfo").read_text()),
                                                  CONTIGUOUS_BLOCK_BYTES, PAGE)
    outcomes = window.add(vmstat)
    mode = read_thp_mode()
    ratio = outcomes.success_ratio if outcomes and mode and thp_faults_compact(*mode) else None
    available = meminfo["MemAvailable"]
    return {
        "mem_available_gib": available / GIB, "mem_free_gib": meminfo["MemFree"] / GIB,
        "cached_gib": meminfo.get("Cached", 0) / GIB, "free_contiguous_gib": contiguous / GIB,
        "headroom_without_reclaim_gib": headroom_without_reclaim(available, contiguous) / GIB,
        "headroom_gib": unified_headroom(available, contiguous, ratio) / GIB,
        "huge_page_fault_success_ratio": -1.0 if ratio is None else ratio,
        "compact_success": vmstat.get("compact_success", 0), "compact_fail": vmstat.get("compact_fail", 0),
        "thp_fault_alloc": vmstat.get("thp_fault_alloc", 0), "thp_fault_fallback": vmstat.get("thp_fault_fallback", 0),
    }


def child_allocate(size: int) -> None:
    """In the capped child: map, advise huge pages, touch one byte per 2 MiB, report AnonHugePages."""
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_HUGEPAGE)
    started = time.perf_counter()
    for offset in range(0, size, HUGE):
        area[offset] = 1
    elapsed = time.perf_counter() - started
    rollup = parse_meminfo(Path("/proc/self/smaps_rollup").read_text().split("\n", 1)[1])
    print(json.dumps({"asked_gib": size / GIB, "huge_gib": rollup.get("AnonHugePages", 0) / GIB,
                      "rss_gib": rollup.get("Rss", 0) / GIB, "seconds": elapsed}))


def allocate(size: int) -> dict[str, float]:
    cap = size + GIB  # the interpreter and the mapping; the child can never map more than this
    code = f"import benchmarks.headroom_thp as b; b.child_allocate({size})"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, cap)))
    if result.returncode != 0:
        raise SystemExit(f"allocation child failed: {result.stderr.strip()[-400:]}")
    return json.loads(result.stdout)


def fill_cache(directory: Path, total_gib: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    chunk = b"\xa5" * (16 << 20)
    for i in range(total_gib // 4):
        path = directory / f"cache-{i}.bin"
        if not path.exists() or path.stat().st_size != 4 * GIB:
            with open(path, "wb") as out:
                for _ in range(4 * GIB // len(chunk)):
                    out.write(chunk)
        with open(path, "rb") as source:
            while source.readinto(bytearray(16 << 20)):
                pass


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


class Pins:
    """One mlocked 4 KiB page of every 2 MiB of a region whose other pages were touched and freed."""

    def __init__(self, size: int) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.area.madvise(mmap.MADV_NOHUGEPAGE)
        for offset in range(0, size, PAGE):
            self.area[offset] = 1
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.area))
        for offset in range(0, size, HUGE):
            if libc.mlock(ctypes.c_void_p(base + offset), ctypes.c_size_t(PAGE)) != 0:
                raise OSError(ctypes.get_errno(), "mlock")
            self.area.madvise(mmap.MADV_DONTNEED, offset + PAGE, HUGE - PAGE)
        self.base = base

    def close(self) -> None:
        self.area.close()


def run_state(name: str, window: FaultWindow, keep_free: int, max_bytes: int) -> dict:
    before = snapshot(window)
    size = min(int(before["mem_available_gib"] * GIB) - keep_free, max_bytes) // HUGE * HUGE
    if size < GIB:
        raise SystemExit(f"{name}: only {before['mem_available_gib']:.1f} GiB available; not allocating")
    got = allocate(size)
    after = snapshot(window)
    row = {"state": name, "before": before, "allocation": got, "after": after}
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", required=True, type=Path)
    parser.add_argument("--cache-gib", type=int, default=28)
    parser.add_argument("--keep-free-gib", type=float, default=6.0)
    parser.add_argument("--max-gib", type=float, default=14.0)
    parser.add_argument("--pin-gib", type=float, default=12.0)
    parser.add_argument("--remove-files", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root: drop_caches and compact_unevictable_allowed")
    keep, cap = int(args.keep_free_gib * GIB), int(args.max_gib * GIB)
    window = FaultWindow()  # the daemon's 300 s window, one sample before and after each allocation
    rows = []
    print(json.dumps({"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      "thp": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip(),
                      "defrag": Path("/sys/kernel/mm/transparent_hugepage/defrag").read_text().strip()}), flush=True)
    fill_cache(args.cache_dir, args.cache_gib)
    rows.append(run_state("page cache full", window, keep, cap))
    drop_caches()
    rows.append(run_state("page cache dropped", window, keep, cap))
    saved = UNEVICTABLE_SYSCTL.read_text()
    for allowed in ("1", "0"):
        drop_caches()
        pins = Pins(int(args.pin_gib * GIB) // HUGE * HUGE)
        try:
            UNEVICTABLE_SYSCTL.write_text(allowed + "\n")
            label = "fragmented, compaction may move the pins" if allowed == "1" else \
                "fragmented, pins unmovable (compact_unevictable_allowed=0)"
            rows.append(run_state(label, window, keep, cap))
        finally:
            UNEVICTABLE_SYSCTL.write_text(saved)
            pins.close()
    if args.remove_files:
        for path in args.cache_dir.glob("cache-*.bin"):
            path.unlink()
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
