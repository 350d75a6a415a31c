"""telemetry/daemon/cli.py: what the daemon builds from its config."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from telemetry.daemon.cli import build_protect
from telemetry.daemon.collectors.headroom import build as build_headroom_collector
from telemetry.daemon.config import from_mapping

PROC = Path(__file__).resolve().parents[1] / "fixtures" / "proc"
SYNTHETIC = PROC / "synthetic"


@pytest.mark.parametrize(("meminfo", "buddyinfo"), [
    (PROC / "meminfo.x86_64-debian12-24g-with-buddyinfo", PROC / "buddyinfo.x86_64-debian12-24g"),
    (SYNTHETIC / "meminfo.gb10-fragmented", SYNTHETIC / "buddyinfo.gb10-fragmented"),
    (SYNTHETIC / "meminfo.gb10-driver-held", SYNTHETIC / "buddyinfo.gb10-driver-held"),
], ids=["real-x86_64", "synthetic-fragmented", "synthetic-driver-held"])
def test_protect_acts_on_the_headroom_the_collector_exports(tmp_path, meminfo, buddyinfo):
    """Protect reads the headroom's definition itself (telemetry.procfs.headroom), not a collector's metrics; this
    holds its figure equal to memtel_node_unified_headroom_bytes on the same /proc, and apart from the figure
    before reclaim (a protect on the old definition fails here)."""
    vmstat = PROC / "vmstat.x86_64-debian12-24g"
    for name, source in (("meminfo", meminfo), ("buddyinfo", buddyinfo), ("vmstat", vmstat)):
        shutil.copyfile(source, tmp_path / name)
    config = from_mapping({"proc_root": str(tmp_path), "protect": {"enabled": True, "command": ["/bin/true"]}})
    registry = CollectorRegistry()
    registry.register(build_headroom_collector(config))

    reading = build_protect(config).sample()

    assert reading is not None
    headroom, mem_total, starts, without_reclaim, ratio = reading
    assert headroom == registry.get_sample_value("memtel_node_unified_headroom_bytes")
    assert headroom != registry.get_sample_value("memtel_node_unified_headroom_without_reclaim_bytes")
    assert mem_total > headroom and starts == {}
    # What a start takes is measured with the same reading's figures (issue 38).
    assert without_reclaim == registry.get_sample_value("memtel_node_unified_headroom_without_reclaim_bytes")
    assert ratio == registry.get_sample_value("memtel_node_huge_page_fault_success_ratio")
