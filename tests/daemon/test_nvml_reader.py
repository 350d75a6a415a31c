"""NvmlReader: the one module that talks to pynvml.

On CI there is no NVIDIA driver, so the driver's answers on a GB10 (NOT_SUPPORTED for device memory, the
running-processes query answering) are played by a stand-in `pynvml` module; the real library runs in the
`gpu` test on the device machine.
"""

from __future__ import annotations

import json
import logging
import sys
import types
from pathlib import Path

import pytest

from telemetry.daemon.collectors.nvml import NvmlCollector, NvmlReader, NvmlSnapshot, nvml_families
from telemetry.daemon.registry import DaemonCollectors

NOT_SUPPORTED, UNKNOWN = 3, 999


class NVMLError(Exception):
    def __init__(self, value):
        super().__init__(value)
        self.value = value


def stand_in_pynvml(memory_error: int | None, power_error: int | None = None,
                    power_milliwatts: int = 43_210) -> types.ModuleType:
    module = types.ModuleType("pynvml")
    module.NVMLError = NVMLError
    module.NVML_ERROR_NOT_SUPPORTED = NOT_SUPPORTED
    module.nvmlInit = lambda: None
    module.nvmlSystemGetDriverVersion = lambda: "580.142"
    module.nvmlDeviceGetCount = lambda: 1
    module.nvmlDeviceGetHandleByIndex = lambda i: f"handle{i}"
    module.nvmlDeviceGetUUID = lambda h: b"GPU-7c2a1e5d"
    module.nvmlDeviceGetName = lambda h: "NVIDIA GB10"

    def memory_info(handle):
        if memory_error is not None:
            raise NVMLError(memory_error)
        return types.SimpleNamespace(total=96 * 2**30, used=10 * 2**30)

    module.nvmlDeviceGetMemoryInfo = memory_info

    def power_usage(handle):
        if power_error is not None:
            raise NVMLError(power_error)
        return power_milliwatts

    module.nvmlDeviceGetPowerUsage = power_usage
    proc = types.SimpleNamespace
    module.nvmlDeviceGetComputeRunningProcesses = lambda h: [proc(pid=41872, usedGpuMemory=97844723712),
                                                             proc(pid=2231, usedGpuMemory=None)]

    def graphics(handle):
        raise NVMLError(NOT_SUPPORTED)

    module.nvmlDeviceGetGraphicsRunningProcesses = graphics
    return module


@pytest.fixture
def fake_nvml(monkeypatch):
    def install(memory_error, **power):
        monkeypatch.setitem(sys.modules, "pynvml", stand_in_pynvml(memory_error, **power))
    return install


def test_not_supported_memory_is_unified_and_processes_still_reported(fake_nvml):
    fake_nvml(NOT_SUPPORTED)
    snapshot = NvmlReader().read()
    gpu = snapshot.gpus[0]
    assert snapshot.driver_version == "580.142" and gpu.uuid == "GPU-7c2a1e5d" and gpu.name == "NVIDIA GB10"
    assert gpu.memory_total_bytes is None and gpu.memory_used_bytes is None
    assert {(p.pid, p.used_bytes) for p in gpu.processes} == {(41872, 97844723712), (2231, None)}


def test_discrete_memory_is_reported(fake_nvml):
    fake_nvml(None)
    gpu = NvmlReader().read().gpus[0]
    assert (gpu.memory_total_bytes, gpu.memory_used_bytes) == (96 * 2**30, 10 * 2**30)


def test_other_nvml_errors_fail_the_collector_not_the_scrape(fake_nvml):
    fake_nvml(UNKNOWN)
    wrapper = DaemonCollectors({"nvml": NvmlCollector()})
    names = {m.name for m in wrapper.collect()}
    assert "memtel_gpu_info" not in names
    assert wrapper.last_success["nvml"] is False


def test_power_is_reported_in_watts(fake_nvml):
    fake_nvml(NOT_SUPPORTED, power_milliwatts=43_210)  # unified memory still reports power (DGX Spark users use it)
    assert NvmlReader().read().gpus[0].power_watts == 43.21
    wrapper = DaemonCollectors({"nvml": NvmlCollector()})
    power = [s for m in wrapper.collect() for s in m.samples if s.name == "memtel_gpu_power_watts"]
    assert [(s.labels, s.value) for s in power] == [({"gpu": "0", "uuid": "GPU-7c2a1e5d"}, 43.21)]


@pytest.mark.parametrize("error", [NOT_SUPPORTED, UNKNOWN])
def test_power_nvml_cannot_say_is_absent_and_the_rest_still_reported(fake_nvml, caplog, error):
    caplog.set_level(logging.INFO)
    fake_nvml(None, power_error=error)
    collector = NvmlCollector()
    for _ in range(3):
        families = {m.name: m for m in DaemonCollectors({"nvml": collector}).collect()}
        assert families["memtel_gpu_power_watts"].samples == []  # left out, not 0
        assert families["memtel_gpu_memory_used_bytes"].samples[0].value == 10 * 2**30
        assert families["memtel_collector_success"].samples[0].value == 1
    assert sum("power usage" in r.getMessage() for r in caplog.records) == 1  # said once per GPU


@pytest.mark.gpu
def test_real_nvml_on_a_gpu_machine():
    snapshot = NvmlReader().read()
    assert snapshot.gpus and snapshot.driver_version
    for gpu in snapshot.gpus:
        assert gpu.uuid.startswith("GPU-")
        if gpu.memory_total_bytes is not None:  # discrete (H200); None on unified memory (GB10)
            assert 0 <= gpu.memory_used_bytes <= gpu.memory_total_bytes
        if "H200" in gpu.name:  # a data-centre GPU reports its power draw
            assert gpu.power_watts is not None and 0 < gpu.power_watts < 1500


NVML_FIXTURES = sorted((Path(__file__).parents[1] / "fixtures" / "nvml").glob("*__*__*.json"))


@pytest.mark.parametrize("fixture", NVML_FIXTURES, ids=[p.stem for p in NVML_FIXTURES])
def test_power_of_each_capture_is_reported_where_it_was_captured(fixture):
    snapshot = NvmlSnapshot.from_dict(json.loads(fixture.read_text()))
    families = {m.name: m for m in nvml_families(snapshot)}
    power = {s.labels["uuid"]: s.value for s in families["memtel_gpu_power_watts"].samples}
    # Captures made before power was read have no `power_watts`: the series is left out for them, never 0.
    assert power == {g.uuid: g.power_watts for g in snapshot.gpus if g.power_watts is not None}
