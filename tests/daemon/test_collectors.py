import json
import logging
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from telemetry.daemon.collectors.meminfo import MeminfoCollector
from telemetry.daemon.collectors.nvml import NvmlCollector, NvmlReader, NvmlSnapshot, nvml_families
from telemetry.daemon.collectors.pressure import PressureCollector
from telemetry.daemon.collectors.processes import ProcessCollector
from telemetry.daemon.collectors.vmstat import VmstatCollector
from telemetry.daemon.registry import DaemonCollectors
from telemetry.daemon.settings import DEFAULT_ROLES, RolePattern

FIXTURES = Path(__file__).parents[1] / "fixtures"
PROC = FIXTURES / "proc"


def sample(registry: CollectorRegistry, name: str, labels: dict[str, str] | None = None) -> float:
    """A sample that must be there (get_sample_value gives None for an absent one)."""
    value = registry.get_sample_value(name, labels)
    assert value is not None, f"{name}{labels or ''} is missing"
    return value


def registry_of(**collectors) -> tuple[CollectorRegistry, DaemonCollectors]:
    wrapper = DaemonCollectors(collectors)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(wrapper)
    return registry, wrapper


def test_meminfo_on_the_real_fixture():
    registry, _ = registry_of(meminfo=MeminfoCollector(str(PROC / "meminfo.x86_64-debian12-24g")))
    total = sample(registry, "memtel_node_mem_total_bytes")
    available = sample(registry, "memtel_node_mem_available_bytes")
    assert total > 20 * 2**30 and 0 < available <= total
    swap_total = sample(registry, "memtel_node_swap_total_bytes")
    assert registry.get_sample_value("memtel_node_swap_used_bytes") == (
        swap_total - sample(registry, "memtel_node_swap_free_bytes"))
    assert registry.get_sample_value("memtel_node_hugepage_size_bytes") == 2 * 2**20
    assert registry.get_sample_value("memtel_node_hugepages_configured_pages") == 0
    assert registry.get_sample_value("memtel_collector_success", {"collector": "meminfo"}) == 1


def test_meminfo_with_reserved_hugepages_exposes_them(tmp_path):
    text = ("MemTotal: 128000000 kB\nMemFree: 9000000 kB\nMemAvailable: 10000000 kB\n"
            "HugePages_Total: 40000\nHugePages_Free: 39000\nHugePages_Rsvd: 100\nHugePages_Surp: 0\n"
            "Hugepagesize: 2048 kB\nHugetlb: 81920000 kB\n")
    path = tmp_path / "meminfo"
    path.write_text(text)
    registry, _ = registry_of(meminfo=MeminfoCollector(str(path)))
    assert registry.get_sample_value("memtel_node_hugetlb_bytes") == 81920000 * 1024
    assert registry.get_sample_value("memtel_node_hugepages_configured_pages") == 40000
    assert registry.get_sample_value("memtel_node_hugepages_reserved_pages") == 100
    assert registry.get_sample_value("memtel_node_swap_used_bytes") is None  # no swap lines: absent, not 0


def test_vmstat_and_pressure_on_real_fixtures():
    registry, _ = registry_of(vmstat=VmstatCollector(str(PROC / "vmstat.x86_64-debian12-24g")),
                              pressure=PressureCollector(str(PROC / "pressure-memory.x86_64-debian12-24g")))
    fixture = dict(line.split() for line in (PROC / "vmstat.x86_64-debian12-24g").read_text().splitlines())
    for field in ("pswpin", "pswpout", "oom_kill", "pgmajfault"):
        assert registry.get_sample_value(f"memtel_node_vmstat_{field}_total") == int(fixture[field])
    assert registry.get_sample_value("memtel_node_pressure_memory_some_seconds_total") is not None
    assert registry.get_sample_value("memtel_node_pressure_memory_full_seconds_total") is not None


class Exploding:
    def collect(self):
        raise RuntimeError("boom")


def test_a_raising_collector_is_reported_and_never_breaks_the_scrape(tmp_path, caplog):
    registry, wrapper = registry_of(
        exploding=Exploding(), vmstat=VmstatCollector(str(PROC / "vmstat.x86_64-debian12-24g")),
        missing=PressureCollector(str(tmp_path / "no-such-file")),
    )
    for _ in range(3):
        assert registry.get_sample_value("memtel_collector_success", {"collector": "exploding"}) == 0
    assert registry.get_sample_value("memtel_collector_success", {"collector": "missing"}) == 0
    assert registry.get_sample_value("memtel_collector_success", {"collector": "vmstat"}) == 1
    assert registry.get_sample_value("memtel_node_vmstat_pswpin_total") is not None
    assert registry.get_sample_value("memtel_node_pressure_memory_some_seconds_total") is None  # omitted, not 0
    assert sample(registry, "memtel_collector_duration_seconds", {"collector": "vmstat"}) >= 0
    assert sample(registry, "memtel_collector_failures_total", {"collector": "exploding"}) >= 3
    assert sum("boom" in r.getMessage() for r in caplog.records) == 1  # the same error is logged once
    health: Any = wrapper.health()
    assert health["collectors"]["exploding"]["success"] is False


def test_self_health_series():
    registry, _ = registry_of()
    first = sample(registry, "memtel_exporter_scrapes_total")
    assert sample(registry, "memtel_exporter_scrapes_total") == first + 1
    assert sample(registry, "memtel_exporter_start_time_seconds") <= time.time()
    samples = [s for m in registry.collect() for s in m.samples if s.name == "memtel_exporter_build_info"]
    assert samples and samples[0].labels["version"]


# -- NVML: fixtures named <platform>__<model>__<driver>.json, one test each ------------------------------
NVML_FIXTURES = sorted((FIXTURES / "nvml").glob("*__*__*.json"))


@pytest.mark.parametrize("fixture", NVML_FIXTURES, ids=[p.stem for p in NVML_FIXTURES])
def test_nvml_snapshot_fixture_renders(fixture):
    snapshot = NvmlSnapshot.from_dict(json.loads(fixture.read_text()))
    families = {m.name: m for m in nvml_families(snapshot, max_processes=2)}
    _platform, _model, driver = fixture.stem.split("__")
    assert snapshot.driver_version == driver
    for gpu in snapshot.gpus:
        ids = {"gpu": str(gpu.index), "uuid": gpu.uuid}
        unified = [s.value for s in families["memtel_gpu_unified_memory"].samples if s.labels == ids]
        used = [s for s in families["memtel_gpu_memory_used_bytes"].samples if s.labels == ids]
        if gpu.memory_total_bytes is None:  # NOT_SUPPORTED: marked, and device memory left out (not 0)
            assert unified == [1] and used == []
        else:
            assert unified == [0] and used[0].value == gpu.memory_used_bytes
        per_process = [s for s in families["memtel_gpu_process_memory_used_bytes"].samples
                       if s.labels["uuid"] == gpu.uuid]
        known = sorted((p.used_bytes for p in gpu.processes if p.used_bytes is not None), reverse=True)
        assert [s.value for s in per_process] == known[:2]  # largest first, bounded
        count = [s.value for s in families["memtel_gpu_processes"].samples if s.labels == ids]
        assert count == [len(gpu.processes)]
        power = [s.value for s in families["memtel_gpu_power_watts"].samples if s.labels == ids]
        assert power == ([] if gpu.power_watts is None else [gpu.power_watts])


def test_the_h200_capture_has_a_real_power_reading():
    snapshot = NvmlSnapshot.from_dict(json.loads((FIXTURES / "nvml" / "hgx__h200__580.159.04.json").read_text()))
    assert [gpu.name for gpu in snapshot.gpus] == ["NVIDIA H200"]
    # 135.1 W read at idle (fixtures README); NVIDIA rates the H200 SXM at up to 700 W (H200 datasheet)
    assert 50 < snapshot.gpus[0].power_watts <= 700


def test_gb10_fixture_reports_the_engine_core_process():
    snapshot = NvmlSnapshot.from_dict(json.loads((FIXTURES / "nvml" / "dgx-spark__gb10__580.142.json").read_text()))
    families = {m.name: m for m in nvml_families(snapshot)}
    by_pid = {s.labels["pid"]: s.value for s in families["memtel_gpu_process_memory_used_bytes"].samples}
    assert by_pid == {"41872": 97844723712, "41790": 524288000}  # the process without a figure is left out


def _nvml_present() -> bool:
    try:
        NvmlReader().read()
        return True
    except Exception:
        return False


def test_nvml_absent_is_reported_once_as_unavailable(caplog):
    caplog.set_level(logging.INFO)
    if _nvml_present():
        pytest.skip("this machine has an NVIDIA driver; the absent case runs on CPU machines (CI)")
    registry, _ = registry_of(nvml=NvmlCollector())
    for _ in range(3):
        assert registry.get_sample_value("memtel_collector_success", {"collector": "nvml"}) == 0
        assert registry.get_sample_value("memtel_gpu_nvml_available") == 0
    assert registry.get_sample_value("memtel_gpu_info") is None
    assert sum("NVML is not available" in r.getMessage() for r in caplog.records) == 1


# -- processes: a real child process named like vLLM's engine core -----------------------------------------
def test_default_roles_match_vllm_process_titles():
    def role_of(cmdline: str):
        return next((r.role for r in DEFAULT_ROLES if r.cmdline.search(cmdline)), None)

    assert role_of("/opt/venv/bin/python3 /opt/venv/bin/vllm serve meta-llama/Llama-3.1-8B --port 8000") == "api_server"
    assert role_of("vllm serve /models/tiny") == "api_server"
    assert role_of("python -m vllm.entrypoints.openai.api_server --model x") == "api_server"
    assert role_of("VLLM::APIServer_0") == "api_server"
    assert role_of("VLLM::EngineCore") == "engine_core" and role_of("VLLM::EngineCore_DP1") == "engine_core"
    assert role_of("VLLM::Worker_TP0") == "worker" and role_of("VLLM::Worker") == "worker"
    assert role_of("python train.py --vllm-serve-compat") is None and role_of("vim vllm_notes.txt") is None


def test_processes_match_roles_by_command_line_and_are_bounded():
    # Real processes under a unique title (vLLM servers of other tests may run on this machine too).
    title = f"VLLM::EngineCore-test-{uuid.uuid4().hex[:8]}"
    role = RolePattern("engine_core", re.compile("^" + re.escape(title)))
    children = [subprocess.Popen(["bash", "-c", f'exec -a "{title}" {sys.executable} -c '
                                                "'import time; x = bytearray(30_000_000); time.sleep(30)'"])
                for _ in range(3)]
    try:
        collector = ProcessCollector((role, RolePattern("worker", re.compile(f"^{title}-none"))), max_per_role=2)
        deadline = time.monotonic() + 10
        while True:
            families = {m.name: m for m in collector.collect()}
            count = [s.value for s in families["memtel_process_role_processes"].samples
                     if s.labels["role"] == "engine_core"]
            rss = [s.value for s in families["memtel_process_resident_bytes"].samples]
            if (count == [3] and rss and min(rss) > 25_000_000) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert count == [3]
        per_process = [s for s in families["memtel_process_resident_bytes"].samples
                       if s.labels["role"] == "engine_core"]
        assert len(per_process) == 2  # bounded by max_per_role
        assert {s.labels["pid"] for s in per_process} <= {str(c.pid) for c in children}
        assert all(s.value > 25_000_000 for s in per_process)  # the 30 MB bytearray is resident
        total = next(s.value for s in families["memtel_process_role_resident_bytes"].samples
                     if s.labels["role"] == "engine_core")
        assert total >= sum(s.value for s in per_process)
        workers = [s.value for s in families["memtel_process_role_processes"].samples if s.labels["role"] == "worker"]
        assert workers == [0]  # every role is present, 0 when nothing runs
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_process_renamed_after_start_is_found_while_young():
    # vLLM renames its engine core (setproctitle) a few seconds after start; here the same pid changes its
    # command line by exec'ing under a new argv[0] after 0.5 s.
    collector = ProcessCollector((RolePattern("engine_core", re.compile(r"^renamed-later")),), recheck_seconds=60)
    child = subprocess.Popen(["bash", "-c", f"sleep 0.5; exec -a renamed-later {sys.executable} -c "
                                            "'import time; time.sleep(30)'"])
    try:
        families = {m.name: m for m in collector.collect()}  # first seen under its original command line
        assert [s.value for s in families["memtel_process_role_processes"].samples] == [0]
        deadline = time.monotonic() + 10
        while True:
            families = {m.name: m for m in collector.collect()}
            pids = [s.labels["pid"] for s in families["memtel_process_resident_bytes"].samples]
            if pids or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert pids == [str(child.pid)]
    finally:
        child.kill()
        child.wait()
