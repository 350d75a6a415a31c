"""/proc/buddyinfo, unaccounted memory and unified headroom: pure parsers on real and synthetic fixtures,
their collectors, and the real daemon with an unreadable buddyinfo.

Real captures are in tests/fixtures/proc/, constructed ones in tests/fixtures/proc/synthetic/ (its README
says which user report each reproduces). Expected figures are worked out by hand in the comments.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from telemetry.daemon.collectors.buddyinfo import BuddyinfoCollector
from telemetry.daemon.collectors.headroom import HeadroomCollector
from telemetry.daemon.collectors.meminfo import MeminfoCollector
from telemetry.daemon.registry import DaemonCollectors
from telemetry.procfs.buddyinfo import (
    CONTIGUOUS_BLOCK_BYTES,
    free_blocks_by_order,
    free_bytes_in_blocks_of_at_least,
    order_of,
    parse_buddyinfo,
)
from telemetry.procfs.meminfo import parse_meminfo
from telemetry.procfs.unaccounted import unaccounted_bytes
from tests.daemon.helpers import Daemon

PROC = Path(__file__).parents[1] / "fixtures" / "proc"
SYNTHETIC = PROC / "synthetic"
KIB, MIB, GIB = 1024, 1024**2, 1024**3


def registry_of(**collectors) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollectors(collectors))
    return registry


def meminfo(path: Path) -> dict[str, int]:
    return parse_meminfo(path.read_text())


# -- buddyinfo parser ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("page_size", "order"), [(4 * KIB, 9), (16 * KIB, 7), (64 * KIB, 5), (2 * MIB, 0)])
def test_the_order_of_a_2_mib_block_follows_the_page_size(page_size, order):
    assert order_of(CONTIGUOUS_BLOCK_BYTES, page_size) == order


def test_a_page_size_that_is_not_a_power_of_two_is_refused():
    with pytest.raises(ValueError, match="power of two"):
        order_of(CONTIGUOUS_BLOCK_BYTES, 3000)


def test_this_machines_buddyinfo():
    zones = parse_buddyinfo((PROC / "buddyinfo.x86_64-debian12-24g").read_text())
    assert [(z.node, z.zone, len(z.free_blocks)) for z in zones] == [(0, "DMA", 11), (0, "DMA32", 11),
                                                                      (0, "Normal", 11)]
    # DMA: 1 × 2 MiB + 3 × 4 MiB = 14 MiB; DMA32: 2 × 2 + 752 × 4 = 3012 MiB; Normal: 228 × 2 + 670 × 4 = 3136 MiB
    assert free_bytes_in_blocks_of_at_least(zones, CONTIGUOUS_BLOCK_BYTES, 4 * KIB) == (14 + 3012 + 3136) * MIB
    assert free_blocks_by_order(zones)[0] == 0 + 2 + 10300 and free_blocks_by_order(zones)[10] == 3 + 752 + 670


def test_arm64_64k_pages_have_14_orders_and_2_mib_is_order_5():
    zones = parse_buddyinfo((SYNTHETIC / "buddyinfo.arm64-64k").read_text())
    assert {len(z.free_blocks) for z in zones} == {14}
    # orders 5..13, block = 64 KiB × 2^order. DMA: 3×2 + 2×4 + 1×8 + 1×16 + 2×512 MiB = 1062 MiB;
    # Normal: 150×2 + 70×4 + 33×8 + 15×16 + 7×32 + 3×64 + 1×128 + 21×512 = 12380 MiB
    assert free_bytes_in_blocks_of_at_least(zones, CONTIGUOUS_BLOCK_BYTES, 64 * KIB) == (1062 + 12380) * MIB
    # Read as if the pages were 4 KiB, the same counts mean something else entirely: the page size matters.
    assert free_bytes_in_blocks_of_at_least(zones, CONTIGUOUS_BLOCK_BYTES, 4 * KIB) != (1062 + 12380) * MIB


def test_high_mem_available_with_almost_no_free_2_mib_blocks():
    zones = parse_buddyinfo((SYNTHETIC / "buddyinfo.gb10-fragmented").read_text())
    values = meminfo(SYNTHETIC / "meminfo.gb10-fragmented")
    assert values["MemAvailable"] == 118 * GIB
    # DMA 1 × order 9, Normal 2 × order 9, nothing above: 3 × 2 MiB
    assert free_bytes_in_blocks_of_at_least(zones, CONTIGUOUS_BLOCK_BYTES, 4 * KIB) == 6 * MIB
    assert free_bytes_in_blocks_of_at_least(zones, 0, 4 * KIB) <= values["MemFree"]  # all orders: within MemFree


def test_malformed_lines_are_skipped_and_nothing_parsed_is_an_error(tmp_path):
    text = "Node 0, zone   Normal  1 2 3\nnonsense\nNode x, zone DMA 1 2\nNode 1, zone Normal 4 five 6\n"
    assert [(z.node, z.free_blocks) for z in parse_buddyinfo(text)] == [(0, (1, 2, 3))]
    path = tmp_path / "buddyinfo"
    path.write_text("MemTotal: 1 kB\n")  # a meminfo file where buddyinfo was expected
    registry = registry_of(buddyinfo=BuddyinfoCollector(str(path), page_size=4096))
    assert registry.get_sample_value("memtel_collector_success", {"collector": "buddyinfo"}) == 0
    assert registry.get_sample_value("memtel_node_mem_free_contiguous_bytes") is None  # left out, not 0


# -- the buddyinfo collector -----------------------------------------------------------------------------
def test_buddyinfo_collector_on_the_real_fixture():
    registry = registry_of(buddyinfo=BuddyinfoCollector(str(PROC / "buddyinfo.x86_64-debian12-24g"), page_size=4096))
    assert registry.get_sample_value("memtel_node_mem_free_contiguous_bytes") == 6162 * MIB
    assert registry.get_sample_value("memtel_node_mem_free_blocks", {"order": "10"}) == 3 + 752 + 670
    assert registry.get_sample_value("memtel_node_page_size_bytes") == 4096
    zones = parse_buddyinfo((PROC / "buddyinfo.x86_64-debian12-24g").read_text())
    assert registry.get_sample_value("memtel_node_mem_free_buddy_bytes") == sum(
        count * 4096 * 2**order for z in zones for order, count in enumerate(z.free_blocks))


def test_free_blocks_are_one_series_per_order_summed_over_nodes_and_zones(tmp_path):
    lines = ["Node 0, zone Normal 1 0 0", "Node 1, zone Normal 2 0 0"]
    lines += [f"Node 0, zone Z{i} 1 1 1" for i in range(20)]  # however many zones: still one series per order
    path = tmp_path / "buddyinfo"
    path.write_text("\n".join(lines) + "\n")
    registry = registry_of(buddyinfo=BuddyinfoCollector(str(path), page_size=4096))
    samples = [s for m in registry.collect() for s in m.samples if s.name == "memtel_node_mem_free_blocks"]
    assert {s.labels["order"]: s.value for s in samples} == {"0": 3 + 20, "1": 20, "2": 20}
    arm64 = registry_of(buddyinfo=BuddyinfoCollector(str(SYNTHETIC / "buddyinfo.arm64-64k"), page_size=65536))
    orders = [s.labels["order"] for m in arm64.collect() for s in m.samples if s.name == "memtel_node_mem_free_blocks"]
    assert orders == [str(o) for o in range(14)]  # the bound: the kernel's number of orders


# -- unaccounted memory ----------------------------------------------------------------------------------
def test_unaccounted_on_this_machines_meminfo():
    values = meminfo(PROC / "meminfo.x86_64-debian12-24g")
    # MemTotal 24684084 − MemFree 23657748 − LRU (152456 + 774944 + 10252) − Slab 50116 − KernelStack 1316
    # − PageTables 2092 − VmallocUsed 14204 − Percpu 712 (KReclaimable = SReclaimable, the rest 0) = 20244 kB
    assert unaccounted_bytes(values) == 20244 * KIB
    # The user's shorter formula (no kernel stacks, vmalloc, per-CPU) gives more: the fields it leaves out.
    user = (values["MemTotal"] - values["MemFree"] - values["Active"] - values["Inactive"] - values["Slab"]
            - values["PageTables"] - values["Unevictable"])
    assert user - unaccounted_bytes(values) == (1316 + 14204 + 712) * KIB


def test_unaccounted_reproduces_the_driver_held_report():
    values = meminfo(SYNTHETIC / "meminfo.gb10-driver-held")
    # 128300000 − 3300000 − (16900000 + 15820000 + 60000) − 1600000 − 40000 − 90000 − 260000 − 45000 kB
    assert unaccounted_bytes(values) == 90185000 * KIB
    assert 77 * GIB < unaccounted_bytes(values) < 90 * GIB  # the range the user saw the driver hold
    assert values["MemAvailable"] == int(22.5 * GIB)  # while MemAvailable still looked comfortable


def test_unaccounted_counts_hugetlb_other_reclaimable_and_optional_fields_once():
    base = {"MemTotal": 1000, "MemFree": 100, "Active": 200, "Inactive": 100, "Unevictable": 50, "Slab": 80,
            "SReclaimable": 60, "KernelStack": 10, "PageTables": 10}
    assert unaccounted_bytes(base) == 1000 - 100 - 350 - 80 - 20
    with_more = {**base, "KReclaimable": 90, "Hugetlb": 100, "Zswap": 5, "GPUActive": 40, "Mlocked": 30,
                 "Cached": 250, "Shmem": 20, "AnonPages": 90}  # Mlocked, Cached, Shmem, AnonPages: inside the LRU
    assert unaccounted_bytes(with_more) == unaccounted_bytes(base) - 30 - 100 - 5 - 40
    older = {**base, "HugePages_Total": 3, "Hugepagesize": 20}  # a kernel without the Hugetlb line
    assert unaccounted_bytes(older) == unaccounted_bytes(base) - 60


def test_unaccounted_is_absent_without_a_required_field_and_not_clamped():
    values = meminfo(PROC / "meminfo.x86_64-debian12-24g")
    del values["Unevictable"]
    assert unaccounted_bytes(values) is None
    negative = {"MemTotal": 100, "MemFree": 50, "Active": 40, "Inactive": 20, "Unevictable": 0, "Slab": 0,
                "KernelStack": 0, "PageTables": 0}
    assert unaccounted_bytes(negative) == -10  # reported as is (docs/metrics.md: counter skew), not hidden as 0


def test_meminfo_collector_exports_unaccounted(tmp_path):
    registry = registry_of(meminfo=MeminfoCollector(str(SYNTHETIC / "meminfo.gb10-driver-held")))
    assert registry.get_sample_value("memtel_node_mem_unaccounted_bytes") == 90185000 * KIB
    path = tmp_path / "meminfo"
    path.write_text("MemTotal: 1000 kB\nMemFree: 10 kB\nMemAvailable: 20 kB\n")  # too few fields for the formula
    registry = registry_of(meminfo=MeminfoCollector(str(path)))
    assert registry.get_sample_value("memtel_node_mem_total_bytes") == 1000 * KIB
    assert registry.get_sample_value("memtel_node_mem_unaccounted_bytes") is None


# -- unified headroom (telemetry/procfs/headroom.py; docs/metrics.md) -------------------------------------------
VMSTAT = PROC / "vmstat.x86_64-debian12-24g"


def thp_sysfs(tmp_path: Path, enabled: str = "always [madvise] never",
              defrag: str = "always defer defer+madvise [madvise] never") -> str:
    directory = tmp_path / "thp"
    directory.mkdir(exist_ok=True)
    (directory / "enabled").write_text(enabled + "\n")
    (directory / "defrag").write_text(defrag + "\n")
    return str(directory)


def headroom_collector(tmp_path, meminfo_file, buddyinfo_file, vmstat_file=VMSTAT, **thp) -> HeadroomCollector:
    return HeadroomCollector(str(meminfo_file), str(buddyinfo_file), page_size=4096, vmstat_path=str(vmstat_file),
                             thp_sysfs=thp_sysfs(tmp_path, **thp))


@pytest.mark.parametrize(("meminfo_file", "buddyinfo_file", "expected"), [
    # a real pair from this VM: contiguous 6162 MiB < MemAvailable 24142580 kB
    (PROC / "meminfo.x86_64-debian12-24g-with-buddyinfo", PROC / "buddyinfo.x86_64-debian12-24g", 6162 * MIB),
    # 118 GiB available, 6 MiB in blocks of >= 2 MiB
    (SYNTHETIC / "meminfo.gb10-fragmented", SYNTHETIC / "buddyinfo.gb10-fragmented", 6 * MIB),
    # driver holds the pool: 22.5 GiB available, 224 MiB contiguous (Normal 40 × 2 MiB + 36 × 4 MiB)
    (SYNTHETIC / "meminfo.gb10-driver-held", SYNTHETIC / "buddyinfo.gb10-driver-held", 224 * MIB),
], ids=["real-x86_64", "synthetic-fragmented", "synthetic-driver-held"])
def test_headroom_without_reclaim_is_the_smaller_of_mem_available_and_contiguous_free(
        tmp_path, meminfo_file, buddyinfo_file, expected):
    registry = registry_of(headroom=headroom_collector(tmp_path, meminfo_file, buddyinfo_file))
    assert registry.get_sample_value("memtel_node_unified_headroom_without_reclaim_bytes") == expected
    # No huge-page fault has fallen back: what is not free in 2 MiB blocks counts as reclaimable into them.
    available = meminfo(meminfo_file)["MemAvailable"]
    assert registry.get_sample_value("memtel_node_unified_headroom_bytes") == available
    assert registry.get_sample_value("memtel_node_huge_page_fault_success_ratio") is None


def vmstat_with_faults(path: Path, alloc: int, fallback: int) -> Path:
    lines = [line for line in VMSTAT.read_text().splitlines() if not line.startswith("thp_fault_")]
    path.write_text("\n".join([*lines, f"thp_fault_alloc {alloc}", f"thp_fault_fallback {fallback}"]) + "\n")
    return path


@pytest.mark.parametrize(("thp", "counted"), [
    ({}, True),  # madvise/madvise: a fault that falls back tried reclaim and compaction first
    ({"enabled": "[always] madvise never", "defrag": "always defer defer+madvise [madvise] never"}, False),
    ({"enabled": "[always] madvise never", "defrag": "[always] defer defer+madvise madvise never"}, True),
    ({"enabled": "always madvise [never]"}, False),
], ids=["madvise", "always-without-defrag", "always-always", "never"])
def test_huge_page_faults_that_fall_back_lower_the_headroom_toward_contiguous_free(tmp_path, thp, counted):
    meminfo_file = SYNTHETIC / "meminfo.gb10-fragmented"
    buddyinfo_file = SYNTHETIC / "buddyinfo.gb10-fragmented"
    vmstat = vmstat_with_faults(tmp_path / "vmstat", 1000, 1000)
    collector = headroom_collector(tmp_path, meminfo_file, buddyinfo_file, vmstat, **thp)
    registry = registry_of(headroom=collector)
    available = meminfo(meminfo_file)["MemAvailable"]
    assert registry.get_sample_value("memtel_node_unified_headroom_bytes") == available  # one sample: no evidence
    vmstat_with_faults(vmstat, 1010, 1030)  # of 40 faults since, 10 got a huge page
    contiguous = 6 * MIB
    expected = contiguous + int(0.25 * (available - contiguous)) if counted else available
    assert registry.get_sample_value("memtel_node_unified_headroom_bytes") == expected
    assert registry.get_sample_value("memtel_node_huge_page_fault_success_ratio") == (0.25 if counted else None)
    assert registry.get_sample_value("memtel_node_unified_headroom_without_reclaim_bytes") == contiguous


def test_headroom_is_mem_available_when_that_is_smaller(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text("MemTotal: 4000000 kB\nMemFree: 3000000 kB\nMemAvailable: 1024 kB\n")
    registry = registry_of(headroom=headroom_collector(tmp_path, path, PROC / "buddyinfo.x86_64-debian12-24g"))
    assert registry.get_sample_value("memtel_node_unified_headroom_bytes") == 1024 * KIB
    assert registry.get_sample_value("memtel_node_unified_headroom_without_reclaim_bytes") == 1024 * KIB


def test_headroom_is_absent_when_buddyinfo_or_vmstat_is_missing(tmp_path):
    for buddyinfo, vmstat in ((tmp_path / "no-buddyinfo", VMSTAT),
                              (PROC / "buddyinfo.x86_64-debian12-24g", tmp_path / "no-vmstat")):
        registry = registry_of(headroom=headroom_collector(tmp_path, PROC / "meminfo.x86_64-debian12-24g",
                                                           buddyinfo, vmstat))
        assert registry.get_sample_value("memtel_node_unified_headroom_bytes") is None
        assert registry.get_sample_value("memtel_collector_success", {"collector": "headroom"}) == 0


# -- the real daemon ---------------------------------------------------------------------------------------
def _proc_root(tmp_path: Path, buddyinfo: Path | None) -> Path:
    proc = tmp_path / "proc"
    (proc / "pressure").mkdir(parents=True)
    (proc / "sys/kernel/random").mkdir(parents=True)
    shutil.copy(PROC / "meminfo.x86_64-debian12-24g-with-buddyinfo", proc / "meminfo")
    shutil.copy(PROC / "vmstat.x86_64-debian12-24g", proc / "vmstat")
    shutil.copy(PROC / "pressure-memory.x86_64-debian12-24g", proc / "pressure" / "memory")
    (proc / "sys/kernel/random/boot_id").write_text("buddyinfo-test-boot\n")
    if buddyinfo is None:
        (proc / "buddyinfo").mkdir()  # unreadable: reading a directory fails (root reads any mode-000 file)
    else:
        shutil.copy(buddyinfo, proc / "buddyinfo")
    return proc


def _fixture_daemon(tmp_path: Path, proc: Path) -> Daemon:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    return Daemon(tmp_path / "state", "--proc-root", str(proc), "--kmsg", str(kmsg), "--disable-collector", "nvml",
                  "--disable-collector", "processes", "--no-flight-recorder")


def test_the_daemon_exports_the_new_signals(tmp_path):
    proc = _proc_root(tmp_path, PROC / "buddyinfo.x86_64-debian12-24g")
    with _fixture_daemon(tmp_path, proc) as daemon:
        scrape = daemon.scrape()
    assert scrape.value("memtel_node_unified_headroom_bytes") == 24142580 * KIB  # no huge-page fault fell back
    assert scrape.value("memtel_node_unified_headroom_without_reclaim_bytes") == 6162 * MIB
    assert scrape.value("memtel_node_mem_free_contiguous_bytes") == 6162 * MIB
    assert scrape.value("memtel_node_mem_unaccounted_bytes") == 134452 * KIB
    assert scrape.value("memtel_collector_success", collector="buddyinfo") == 1


def test_unreadable_buddyinfo_fails_its_collectors_and_the_scrape_goes_on(tmp_path):
    proc = _proc_root(tmp_path, None)
    with _fixture_daemon(tmp_path, proc) as daemon:
        scrape = daemon.scrape()  # asserts status 200
        log = daemon.log()
    assert scrape.value("memtel_collector_success", collector="buddyinfo") == 0
    assert scrape.value("memtel_collector_success", collector="headroom") == 0
    assert scrape.value("memtel_node_mem_free_contiguous_bytes") is None
    assert scrape.value("memtel_node_unified_headroom_bytes") is None
    assert scrape.value("memtel_node_mem_available_bytes") == 24142580 * KIB  # the other collectors still report
    assert scrape.value("memtel_collector_success", collector="meminfo") == 1
    assert "collector buddyinfo failed" in log and "Traceback" not in log
