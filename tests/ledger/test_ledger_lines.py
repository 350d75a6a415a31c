"""The ledger's lines (telemetry/ledger/lines.py): they add up on real and recorded /proc/meminfo files, the
recording rules compute the same numbers from the same inputs (promtool), and the hook reads the engine's
weights and KV cache from its tensors, each storage once."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

import telemetry
from telemetry.hook.config import HookConfig
from telemetry.hook.engine import private_pool_bytes, storage_bytes
from telemetry.ledger.lines import NodeLedger, ProcessLedger
from telemetry.procfs.meminfo import parse_meminfo
from telemetry.procfs.unaccounted import unaccounted_bytes
from tests.ledger import engine_process

FIXTURES = Path(__file__).parents[1] / "fixtures"
MEMINFO_FILES = sorted([*FIXTURES.glob("proc/meminfo.*"), *FIXTURES.glob("proc/synthetic/meminfo.*")])
GB10_NVML = FIXTURES / "nvml" / "dgx-spark__gb10__580.142.json"
RULES = Path(__file__).parents[2] / "dashboards" / "prometheus" / "memtel-recording.yml"


def node_ledger(meminfo: dict[str, int], gpu: list[int] | None = None, unified: bool | None = None) -> NodeLedger:
    return NodeLedger.from_values(mem_total=meminfo["MemTotal"], mem_free=meminfo["MemFree"],
                                  active_file=meminfo["Active(file)"], inactive_file=meminfo["Inactive(file)"],
                                  unaccounted=unaccounted_bytes(meminfo), gpu_process_bytes=gpu, unified=unified)


def gb10_process_bytes() -> list[int]:
    gpus = json.loads(GB10_NVML.read_text())["gpus"]
    return [p["used_bytes"] for g in gpus for p in g["processes"] if p["used_bytes"] is not None]


@pytest.mark.parametrize("path", [*MEMINFO_FILES, Path("/proc/meminfo")], ids=lambda p: p.name)
def test_the_node_lines_add_up_to_the_memory_in_use(path):
    meminfo = parse_meminfo(path.read_text())
    ledger = node_ledger(meminfo)
    assert ledger.used == meminfo["MemTotal"] - meminfo["MemFree"]
    assert ledger.gpu_processes is None and ledger.unexplained == unaccounted_bytes(meminfo)
    assert ledger.adds_up(), ledger
    assert ledger.page_cache == meminfo["Active(file)"] + meminfo["Inactive(file)"]


def test_on_unified_memory_the_processes_gpu_memory_is_taken_out_of_what_nothing_explains():
    meminfo = parse_meminfo((FIXTURES / "proc/synthetic/meminfo.gb10-driver-held").read_text())
    gpu = gb10_process_bytes()
    unified, discrete = node_ledger(meminfo, gpu, True), node_ledger(meminfo, gpu, False)
    assert unified.gpu_processes == sum(gpu) > 0
    assert unified.unexplained == unaccounted_bytes(meminfo) - sum(gpu)
    assert unified.adds_up() and discrete.adds_up()
    # On a discrete GPU its memory is not host memory: nothing of the host is explained by it.
    assert discrete.gpu_processes is None and discrete.unexplained == unaccounted_bytes(meminfo)


def test_a_missing_input_leaves_its_line_unknown_not_zero():
    ledger = NodeLedger.from_values(mem_total=100, mem_free=10, active_file=None, inactive_file=5, unaccounted=20,
                                    gpu_process_bytes=None, unified=None)
    assert ledger.page_cache is None and ledger.other_host is None and not ledger.adds_up()
    process = ProcessLedger.from_values(rank="0", pid="1", weights=10, kv_cache=None, cuda_graph_pool=None,
                                        reserved=None, allocated=50, nvml_process_bytes=70, device_used_bytes=None,
                                        host_rss=None)
    assert process.live_other is None and process.allocator_cache is None and process.outside is None


def test_process_lines_from_nvml_and_from_the_device_as_an_upper_bound():
    common = dict(rank="0", pid="7", weights=40, kv_cache=30, cuda_graph_pool=None, reserved=100, allocated=80,
                  host_rss=5)
    nvml = ProcessLedger.from_values(**common, nvml_process_bytes=130, device_used_bytes=500)
    assert (nvml.live_other, nvml.allocator_cache, nvml.outside, nvml.outside_basis) == (10, 20, 30, "nvml_process")
    device = ProcessLedger.from_values(**common, nvml_process_bytes=None, device_used_bytes=500)
    assert (device.outside, device.outside_basis) == (400, "device_used")


def promtool_or_fail() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is missing: scripts/test installs Debian's prometheus package")
    return found


@pytest.mark.prometheus
def test_the_recording_rules_give_the_same_lines_as_the_ledger(tmp_path):
    meminfo = parse_meminfo((FIXTURES / "proc/synthetic/meminfo.gb10-driver-held").read_text())
    gpu = gb10_process_bytes()
    ledger = node_ledger(meminfo, gpu, True)
    node = 'job="memtel-daemon", instance="gb10-a:9101", node="gb10-a"'
    series = {"memtel_node_mem_total_bytes": meminfo["MemTotal"], "memtel_node_mem_free_bytes": meminfo["MemFree"],
              "memtel_node_mem_active_file_bytes": meminfo["Active(file)"],
              "memtel_node_mem_inactive_file_bytes": meminfo["Inactive(file)"],
              "memtel_node_mem_unaccounted_bytes": unaccounted_bytes(meminfo)}
    inputs = [{"series": f"{name}{{{node}}}", "values": f"{value}x3"} for name, value in series.items()]
    inputs += [{"series": f'memtel_gpu_process_memory_used_bytes{{{node}, gpu="0", uuid="u", pid="{i}"}}',
                "values": f"{value}x3"} for i, value in enumerate(gpu)]
    inputs.append({"series": f'memtel_gpu_unified_memory{{{node}, gpu="0", uuid="u"}}', "values": "1x3"})
    # a process: hook series (rank, pid) and NVML's figure for its pid
    hook = 'job="memtel-hook", instance="gb10-a:9200", node="gb10-a", rank="0", pid="0"'
    engine = {"memtel_engine_weights_bytes": 40 << 30, "memtel_engine_kv_cache_bytes": 30 << 30,
              "memtel_engine_allocator_reserved_at_scrape_bytes": 90 << 30,
              "memtel_engine_allocator_allocated_at_scrape_bytes": 80 << 30}
    inputs += [{"series": f"{name}{{{hook}}}", "values": f"{value}x3"} for name, value in engine.items()]
    process = ProcessLedger.from_values(rank="0", pid="0", weights=40 << 30, kv_cache=30 << 30, cuda_graph_pool=None,
                                        reserved=90 << 30, allocated=80 << 30, nvml_process_bytes=gpu[0],
                                        device_used_bytes=None, host_rss=None)
    node_labels = f"{{{node}}}"
    expected = [
        ("instance:memtel_ledger_used_bytes:current", node_labels, ledger.used),
        ("instance:memtel_ledger_page_cache_bytes:current", node_labels, ledger.page_cache),
        ("node:memtel_ledger_gpu_processes_bytes:sum", '{node="gb10-a"}', ledger.gpu_processes),
        ("instance:memtel_ledger_unexplained_bytes:current", node_labels, ledger.unexplained),
        ("instance:memtel_ledger_other_host_bytes:current", node_labels, ledger.other_host),
        ("rank:memtel_ledger_live_other_bytes:current", f"{{{hook}}}", process.live_other),
        ("rank:memtel_ledger_allocator_cache_bytes:current", f"{{{hook}}}", process.allocator_cache),
        ("rank:memtel_ledger_outside_allocator_bytes:current", f"{{{hook}}}", process.outside),
    ]
    test = {"rule_files": [str(RULES)], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": inputs, "promql_expr_test": [
                {"expr": name, "eval_time": "1m", "exp_samples": [{"labels": name + labels, "value": value}]}
                for name, labels, value in expected]}]}
    path = tmp_path / "ledger_test.yml"
    path.write_text(json.dumps(test))
    result = subprocess.run([promtool_or_fail(), "test", "rules", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_hook_reads_weights_and_kv_cache_from_the_engines_tensors():
    registry = CollectorRegistry()
    module = "tests.ledger.engine_process"
    config = HookConfig(targets=(f"{module}:unused_target",), port=None, unresolved_after_s=None,
                        model_loaded=(f"{module}:Worker.load_model",),
                        engine_memory=(f"{module}:Worker.initialize_from_config",))
    handle = telemetry.hook.install_config(config, registry=registry)
    try:
        worker = engine_process.Worker()
        assert registry.get_sample_value("memtel_engine_weights_bytes", {"rank": "0", "node": handle.state.node,
                                                                         "pid": str(__import__("os").getpid())}) is None
        worker.load_model()
        worker.initialize_from_config(32)
        want = engine_process.expected(worker, 32)
        labels = {"rank": "0", "node": handle.state.node, "pid": str(__import__("os").getpid())}
        assert registry.get_sample_value("memtel_engine_weights_bytes", labels) == want["weights_bytes"]
        # three layers, two storages: the shared layer counts once
        assert registry.get_sample_value("memtel_engine_kv_cache_bytes", labels) == want["kv_cache_bytes"]
        assert registry.get_sample_value("memtel_engine_resident_bytes", labels) > 0
        # no CUDA here: the allocator and device lines are absent, not 0
        assert registry.get_sample_value("memtel_engine_allocator_reserved_at_scrape_bytes", labels) is None
    finally:
        handle.uninstall()


def test_storages_count_once_and_private_pools_leave_out_the_kv_caches_pool():
    base = torch.zeros(1024)
    total, device, keys = storage_bytes([base, base[:10], base.view(32, 32), torch.zeros(10)])
    assert (total, device, len(keys)) == (1024 * 4 + 40, "cpu", 2)
    segments = [{"segment_pool_id": (0, 0), "address": 0, "total_size": 2 << 20},
                {"segment_pool_id": (1, 1), "address": 1 << 30, "total_size": 4 << 20},     # graphs
                {"segment_pool_id": (1, 2), "address": 2 << 30, "total_size": 8 << 20}]    # the KV cache's pool
    assert private_pool_bytes(segments, {("cuda:0", (2 << 30) + 4096)}) == 4 << 20
