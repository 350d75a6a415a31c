"""Unified-memory emulation: simulated segments are real host pages, taken and given back."""

from __future__ import annotations

import os
import time

import httpx
import psutil
import pytest

from harness.labserver.unified_memory import HostBacking, parse_percpu_pagesets, read_percpu_pagesets
from telemetry.model.allocsim import CachingAllocatorSim
from telemetry.procfs.meminfo import MeminfoReader
from tests.labserver.conftest import LabServer

MIB = 1 << 20
SEGMENT = 768 * MIB


def _available_with_percpu_lists() -> int:
    """MemAvailable plus the pages parked on the kernel's per-CPU free lists (uncounted since 6.7)."""
    pcp = read_percpu_pagesets() or {"count_bytes": 0}
    return MeminfoReader().read()["MemAvailable"] + pcp["count_bytes"]


def test_mapping_a_segment_moves_rss_exactly_and_memavailable_for_real():
    process = psutil.Process()
    backing = HostBacking()
    # MemAvailable is machine-wide: other processes move it too, so a measurement disturbed by them is
    # repeated (at most 3 times). Freed pages the kernel parks on its per-CPU lists are added back in.
    moves = []
    for _attempt in range(3):
        rss0, available0 = process.memory_info().rss, _available_with_percpu_lists()
        backing.map("seg", SEGMENT)
        rss1, available1 = process.memory_info().rss, _available_with_percpu_lists()
        backing.unmap("seg", SEGMENT)
        rss2, available2 = process.memory_info().rss, _available_with_percpu_lists()
        # The process's own pages: the segment's, give or take what this process's other threads freed or took
        # meanwhile (CI saw 13 pages fewer: the worker's own threads run on).
        assert abs(rss1 - rss0 - SEGMENT) < 16 * MIB and abs(rss2 - rss0) < 16 * MIB, (rss0, rss1, rss2)
        assert backing.mapped_bytes == 0 and len(backing) == 0
        moves.append(((available0 - available1) / MIB, (available2 - available1) / MIB))
        if all(0.85 * SEGMENT <= m * MIB <= 1.15 * SEGMENT for m in moves[-1]):
            break
        time.sleep(1.0)
    else:
        pytest.fail(f"MemAvailable (+ per-CPU free lists) moved by {moves} MiB (map, unmap) for a "
                    f"{SEGMENT / MIB:.0f} MiB segment")


def test_partial_unmap_releases_the_tail_of_a_segment():
    process = psutil.Process()
    backing = HostBacking()
    rss0 = process.memory_info().rss
    backing.map(1, 64 * MIB)
    backing.map(1, 32 * MIB)  # a second map call of the same segment (expandable segments do this)
    backing.unmap(1, 48 * MIB)  # all of the second mapping and 16 MiB of the first
    assert backing.mapped_bytes == 48 * MIB
    assert abs(process.memory_info().rss - rss0 - 48 * MIB) < 8 * MIB
    backing.unmap(1)
    assert backing.mapped_bytes == 0 and abs(process.memory_info().rss - rss0) < 8 * MIB


def test_simulator_segments_are_backed_while_reserved():
    backing = HostBacking()
    sim = CachingAllocatorSim("", on_segment_map=backing.map, on_segment_unmap=backing.unmap)
    a = sim.malloc(100 * MIB)
    b = sim.malloc(30 * MIB)
    assert backing.mapped_bytes == sim.reserved_bytes == 130 * MIB
    sim.free(a)
    assert backing.mapped_bytes == 130 * MIB  # cached, not released: still host memory
    sim.empty_cache()
    assert backing.mapped_bytes == sim.reserved_bytes == 30 * MIB
    sim.free(b)
    sim.empty_cache()
    assert backing.mapped_bytes == 0


def test_expandable_segments_map_and_unmap_pages():
    backing = HostBacking()
    sim = CachingAllocatorSim("expandable_segments:True", on_segment_map=backing.map,
                              on_segment_unmap=backing.unmap)
    handles = [sim.malloc(size * MIB) for size in (30, 50, 70)]
    assert backing.mapped_bytes == sim.reserved_bytes
    for handle in handles:
        sim.free(handle)
    sim.empty_cache()
    assert backing.mapped_bytes == sim.reserved_bytes == 0


def test_percpu_pagesets_parser():
    text = ("Node 0, zone   Normal\n  pages free 5\n  pagesets\n    cpu: 0\n              count:    10\n"
            "              high:     20\n              batch:    1\n              high_min: 2\n"
            "              high_max: 30\n    cpu: 1\n              count:    1\n              high:     2\n"
            "              high_max: 3\n  node_unreclaimable:  0\nNode 0, zone  Movable\n  pages free 0\n")
    assert parse_percpu_pagesets(text, page_size=4096) == {"count_bytes": 11 * 4096, "high_bytes": 22 * 4096,
                                                             "high_max_bytes": 33 * 4096}
    assert parse_percpu_pagesets("Node 0, zone DMA\n  pages free 1\n") is None


def _ranks(server: LabServer) -> list[psutil.Process]:
    return [p for p in psutil.Process(server.running.pid).children() if "spawn_main" in " ".join(p.cmdline())]


def test_lab_server_ranks_hold_their_reserved_memory_in_host_pages(tmp_path):
    """A stock prefill on the simulator: each rank's resident memory grows by its reserved bytes."""
    args = ["--layers", "2", "--chunk", "4096", "--max-model-len", "65536", "--budget-mb", "512", "--scale", "1",
            "--time-scale", "0"]
    with LabServer(tmp_path, *args) as server:
        ranks = _ranks(server)
        assert len(ranks) == 2
        rss0 = [p.memory_info().rss for p in ranks]
        response = httpx.post(server.url + "/v1/completions", timeout=120,
                              json={"prompt": " ".join(f"u{i}" for i in range(16384)), "max_tokens": 1})
        assert response.status_code == 200
        from tests.support.prom import metric

        for rank, process in enumerate(ranks):
            reserved = metric(server.rank_url(rank), "memtel_allocator_reserved_bytes")
            # 4 chunk steps of 4,096 rows x N = 1,024..4,096 columns: 16..64 MiB each, kept alive in pairs.
            assert reserved is not None and reserved >= 100 * MIB
            grown = process.memory_info().rss - rss0[rank]
            assert abs(grown - reserved) < 12 * MIB, (rank, grown / MIB, reserved / MIB)
            hook_available = metric(server.rank_url(rank), "memtel_hook_host_mem_available_bytes")
            assert hook_available is not None and hook_available > 0
    for process in ranks:
        assert not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    assert os.path.exists(server.log_dir)
