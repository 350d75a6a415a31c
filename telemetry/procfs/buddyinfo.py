"""/proc/buddyinfo: the page allocator's free blocks per node, zone and order; a pure parser.

Each line is `Node <n>, zone <name> <c0> <c1> ... <cK>`: column k counts the free blocks of 2^k
physically contiguous pages (Documentation/filesystems/proc.rst, section "buddyinfo"). The number of
columns is the kernel's number of orders, MAX_PAGE_ORDER + 1: 11 on x86-64 and on arm64 with 4 KiB
pages, 12 with 16 KiB pages, 14 with 64 KiB pages (arch/arm64/Kconfig, ARCH_FORCE_MAX_ORDER). A block
of order k is 2^k × the page size, so which column holds 2 MiB blocks depends on the page size:
order 9 with 4 KiB pages, 7 with 16 KiB, 5 with 64 KiB.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from telemetry.procfs.procfile import ProcFile

BUDDYINFO_PATH = "/proc/buddyinfo"
CONTIGUOUS_BLOCK_BYTES = 2 * 1024 * 1024  # what a GPU driver's large-page allocation asks for
MAX_ORDERS = 32  # a sanity bound on the columns of one line (kernels print 11 to 14)

_LINE = re.compile(r"^Node\s+(\d+),\s*zone\s+(\S+)((?:\s+\d+)+)\s*$")


@dataclass(frozen=True)
class ZoneFreeBlocks:
    """One line of buddyinfo: free blocks of one zone of one node, by order (index = order)."""

    node: int
    zone: str
    free_blocks: tuple[int, ...]


def parse_buddyinfo(text: str) -> tuple[ZoneFreeBlocks, ...]:
    """Every well-formed line of buddyinfo text; malformed lines are skipped (the caller decides
    whether an empty result is an error)."""
    zones = []
    for line in text.splitlines():
        match = _LINE.match(line)
        if not match:
            continue
        counts = tuple(int(field) for field in match.group(3).split())
        if len(counts) > MAX_ORDERS:
            continue
        zones.append(ZoneFreeBlocks(int(match.group(1)), match.group(2), counts))
    return tuple(zones)


def read_free_blocks(file: ProcFile) -> tuple[ZoneFreeBlocks, ...]:
    """The zones of a buddyinfo file read now; ValueError for a file without one (not a buddyinfo file)."""
    zones = parse_buddyinfo(file.read_text())
    if not zones:
        raise ValueError(f"{file.path} has no `Node N, zone NAME counts...` lines: not a buddyinfo file")
    return zones


def system_page_size() -> int:
    return os.sysconf("SC_PAGE_SIZE")


def order_of(block_bytes: int, page_size: int) -> int:
    """The smallest order whose blocks hold `block_bytes`: 2 MiB is order 9 with 4 KiB pages."""
    if page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"page size {page_size} is not a positive power of two")
    order = 0
    while page_size << order < block_bytes:
        order += 1
    return order


def free_bytes_in_blocks_of_at_least(zones: tuple[ZoneFreeBlocks, ...], block_bytes: int, page_size: int) -> int:
    """Bytes free in blocks of at least `block_bytes`, summed over every node and zone."""
    first = order_of(block_bytes, page_size)
    return sum(
        count * (page_size << order)
        for zone in zones
        for order, count in enumerate(zone.free_blocks)
        if order >= first
    )


def free_blocks_by_order(zones: tuple[ZoneFreeBlocks, ...]) -> list[int]:
    """Free blocks per order (index = order), summed over every node and zone."""
    totals = [0] * max((len(zone.free_blocks) for zone in zones), default=0)
    for zone in zones:
        for order, count in enumerate(zone.free_blocks):
            totals[order] += count
    return totals
