"""Memory that no /proc/meminfo field accounts for: a pure function over parsed meminfo.

The kernel's documentation warns that meminfo's counters overlap and that "the memory reported by the
non overlapping counters may not add up to the overall memory usage" (Documentation/filesystems/proc.rst,
"meminfo"). This takes one non-overlapping set, each page counted once, and subtracts it from MemTotal:

    unaccounted = MemTotal − MemFree
                − (Active + Inactive + Unevictable)      every page on an LRU list, each on exactly one
                − Slab                                   SReclaimable + SUnreclaim
                − (KReclaimable − SReclaimable)          KReclaimable includes SReclaimable
                − KernelStack − ShadowCallStack − PageTables − SecPageTables
                − VmallocUsed − Percpu − Zswap − Ftrace − Bounce − WritebackTmp
                − GPUActive − GPUReclaim
                − huge pages (Hugetlb; older kernels: HugePages_Total × Hugepagesize)

Not subtracted because they are already inside the LRU lists: Buffers, Cached (which includes Shmem
and excludes SwapCached), SwapCached, AnonPages, Mapped, Shmem, Mlocked (part of Unevictable), Dirty,
Writeback and the *HugePages/*PmdMapped fields. docs/metrics.md gives the reasoning and the caveats;
on unified-memory machines what remains is mostly what GPU drivers allocated from the page allocator.
"""

from __future__ import annotations

# A kernel that lacks one of these is not one this formula was derived for: the result is None.
REQUIRED_FIELDS = ("MemTotal", "MemFree", "Active", "Inactive", "Unevictable", "Slab", "KernelStack", "PageTables")
# Kernel memory outside the LRU lists and Slab, each with its own field; a field this kernel does not
# print (older kernel, option compiled out) has nothing to subtract.
OPTIONAL_FIELDS = ("ShadowCallStack", "SecPageTables", "VmallocUsed", "Percpu", "Zswap", "Ftrace", "Bounce",
                   "WritebackTmp", "GPUActive", "GPUReclaim")


def huge_page_bytes(meminfo: dict[str, int]) -> int:
    """Memory held by hugetlb pools: `Hugetlb` (all sizes), or the default size's pool on kernels without it."""
    if "Hugetlb" in meminfo:
        return meminfo["Hugetlb"]
    return meminfo.get("HugePages_Total", 0) * meminfo.get("Hugepagesize", 0)


def unaccounted_bytes(meminfo: dict[str, int]) -> int | None:
    """MemTotal minus every non-overlapping meminfo field (bytes; see the module docstring).

    None when a required field is missing. The result is not clamped: the fields are read one after
    another and per-CPU counters are folded in lazily, so values a little below zero are noise; a large
    negative value means this kernel counts something twice that the formula assumes it does not.
    """
    if any(field not in meminfo for field in REQUIRED_FIELDS):
        return None
    lru = meminfo["Active"] + meminfo["Inactive"] + meminfo["Unevictable"]
    other_reclaimable = 0
    if "KReclaimable" in meminfo:
        other_reclaimable = meminfo["KReclaimable"] - meminfo.get("SReclaimable", 0)
    kernel = (meminfo["Slab"] + other_reclaimable + meminfo["KernelStack"] + meminfo["PageTables"]
              + sum(meminfo.get(field, 0) for field in OPTIONAL_FIELDS))
    return meminfo["MemTotal"] - meminfo["MemFree"] - lru - kernel - huge_page_bytes(meminfo)
