"""nvml collector: per-GPU memory, the unified-memory marker and per-process GPU memory.

All NVML access is in `NvmlReader` (the only code that imports pynvml, from nvidia-ml-py). It turns
the driver's answers into an `NvmlSnapshot`; `nvml_families` renders a snapshot, so tests and the
capture fixtures (`python -m telemetry.daemon.collectors.nvml > capture.json`) use the same path.

Normal states, not errors: no NVML library (a CPU box: the collector reports unavailable, with
`memtel_gpu_nvml_available 0`, logged once), and NOT_SUPPORTED for device memory (unified memory,
e.g. DGX Spark/GB10: GPU memory is host memory; logged once per GPU). The running-processes query
still answers on unified memory, so per-process GPU memory is reported there.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

from telemetry.catalogue import metrics as catalogue
from telemetry.daemon.registry import CollectorUnavailable, register

if TYPE_CHECKING:
    from telemetry.daemon.settings import DaemonConfig

log = logging.getLogger("memtel.daemon.nvml")


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int | None  # None: the driver does not say
    name: str = ""


@dataclass(frozen=True)
class GpuReading:
    index: int
    uuid: str
    name: str
    memory_total_bytes: int | None  # None: NOT_SUPPORTED (unified memory)
    memory_used_bytes: int | None
    processes: tuple[GpuProcess, ...] = ()
    power_watts: float | None = None  # None: NOT_SUPPORTED (or NVML could not say)


@dataclass(frozen=True)
class NvmlSnapshot:
    driver_version: str
    gpus: tuple[GpuReading, ...]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NvmlSnapshot:
        gpus = tuple(
            GpuReading(
                index=g["index"], uuid=g["uuid"], name=g["name"],
                memory_total_bytes=g.get("memory_total_bytes"), memory_used_bytes=g.get("memory_used_bytes"),
                processes=tuple(GpuProcess(**p) for p in g.get("processes", ())),
                power_watts=g.get("power_watts"),
            )
            for g in data["gpus"]
        )
        return cls(driver_version=data["driver_version"], gpus=gpus)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class NvmlUnavailableError(Exception):
    pass


class NvmlReader:
    """The one place that talks to pynvml. Initialises lazily; retries a failed init every `retry_seconds`."""

    def __init__(self, retry_seconds: float = 60.0) -> None:
        self.retry_seconds = retry_seconds
        self._nvml: Any = None
        self._failed_at: float | None = None
        self._failure = ""
        self._process_names: dict[int, str] = {}
        self._power_logged: set[int] = set()

    def _init(self) -> Any:
        if self._nvml is not None:
            return self._nvml
        if self._failed_at is not None and time.monotonic() - self._failed_at < self.retry_seconds:
            raise NvmlUnavailableError(self._failure)
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
            self._failed_at = time.monotonic()
            self._failure = f"NVML is not available ({exc}); normal on a machine without an NVIDIA driver"
            raise NvmlUnavailableError(self._failure) from None
        self._nvml = pynvml
        return pynvml

    def read(self) -> NvmlSnapshot:
        nvml = self._init()
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            total = used = None
            try:
                info = nvml.nvmlDeviceGetMemoryInfo(handle)
                total, used = int(info.total), int(info.used)
            except nvml.NVMLError as exc:
                if exc.value != nvml.NVML_ERROR_NOT_SUPPORTED:
                    raise
            gpus.append(GpuReading(
                index=index, uuid=_text(nvml.nvmlDeviceGetUUID(handle)), name=_text(nvml.nvmlDeviceGetName(handle)),
                memory_total_bytes=total, memory_used_bytes=used, processes=self._processes(nvml, handle),
                power_watts=self._power(nvml, handle, index),
            ))
        return NvmlSnapshot(driver_version=driver, gpus=tuple(gpus))

    def _power(self, nvml: Any, handle: Any, index: int) -> float | None:
        """Power draw in watts (NVML answers milliwatts); None where NVML cannot say, logged once per GPU."""
        try:
            return int(nvml.nvmlDeviceGetPowerUsage(handle)) / 1000.0
        except nvml.NVMLError as exc:
            if index not in self._power_logged:
                self._power_logged.add(index)
                log.info("GPU %d: NVML cannot report power usage (%s); %s left out", index, exc,
                         catalogue.GPU_POWER.series)
            return None

    def _processes(self, nvml: Any, handle: Any) -> tuple[GpuProcess, ...]:
        used: dict[int, int | None] = {}
        for query in (nvml.nvmlDeviceGetComputeRunningProcesses, nvml.nvmlDeviceGetGraphicsRunningProcesses):
            try:
                found = query(handle)
            except nvml.NVMLError:
                continue
            for proc in found:
                amount = proc.usedGpuMemory
                previous = used.get(proc.pid)
                used[proc.pid] = amount if previous is None else max(previous, amount or 0)
        return tuple(GpuProcess(pid, amount, self._process_name(pid)) for pid, amount in used.items())

    def _process_name(self, pid: int) -> str:
        if pid not in self._process_names:
            try:
                import psutil

                self._process_names[pid] = psutil.Process(pid).name()
            except Exception:  # another PID namespace, or gone already
                self._process_names[pid] = ""
            if len(self._process_names) > 4096:  # bounded: forget old pids
                self._process_names.clear()
        return self._process_names[pid]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_available_family(available: bool) -> Metric:
    return catalogue.GPU_NVML_AVAILABLE.new(1 if available else 0)


def nvml_families(snapshot: NvmlSnapshot, max_processes: int = 32) -> list[Metric]:
    info = catalogue.GPU_INFO.new()
    unified = catalogue.GPU_UNIFIED_MEMORY.new()
    used = catalogue.GPU_MEMORY_USED.new()
    total = catalogue.GPU_MEMORY_TOTAL.new()
    proc_used = catalogue.GPU_PROCESS_MEMORY_USED.new()
    proc_count = catalogue.GPU_PROCESSES.new()
    power = catalogue.GPU_POWER.new()
    for gpu in snapshot.gpus:
        ids = [str(gpu.index), gpu.uuid]
        info.add_metric([*ids, gpu.name, snapshot.driver_version], 1)
        unified.add_metric(ids, 1 if gpu.memory_total_bytes is None else 0)
        if gpu.memory_total_bytes is not None and gpu.memory_used_bytes is not None:
            used.add_metric(ids, gpu.memory_used_bytes)
            total.add_metric(ids, gpu.memory_total_bytes)
        known = sorted(((p, p.used_bytes) for p in gpu.processes if p.used_bytes is not None), key=lambda k: -k[1])
        for proc, amount in known[:max_processes]:
            proc_used.add_metric([*ids, str(proc.pid), proc.name], amount)
        proc_count.add_metric(ids, len(gpu.processes))
        if gpu.power_watts is not None:
            power.add_metric(ids, gpu.power_watts)
    return [nvml_available_family(True), info, unified, used, total, proc_used, proc_count, power]


class NvmlCollector:
    def __init__(self, reader: NvmlReader | None = None, max_processes: int = 32) -> None:
        self.reader = reader or NvmlReader()
        self.max_processes = max_processes
        self._unified_logged: set[str] = set()

    def collect(self) -> list[Metric]:
        try:
            snapshot = self.reader.read()
        except NvmlUnavailableError as exc:
            raise CollectorUnavailable(str(exc), [nvml_available_family(False)]) from None
        for gpu in snapshot.gpus:
            if gpu.memory_total_bytes is None and gpu.uuid not in self._unified_logged:
                self._unified_logged.add(gpu.uuid)
                log.info("GPU %d (%s): NVML reports device memory as NOT_SUPPORTED: unified memory; "
                         "reporting per-process GPU memory and host MemAvailable instead", gpu.index, gpu.name)
        return nvml_families(snapshot, self.max_processes)


def main() -> int:
    """Print this machine's NVML snapshot as JSON: a capture for tests/fixtures/nvml/."""
    try:
        snapshot = NvmlReader().read()
    except NvmlUnavailableError as exc:
        print(f"memtel: {exc}", file=sys.stderr)
        return 1
    json.dump(snapshot.to_dict(), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())


@register("nvml", order=60, help="GPU memory, the unified-memory marker, per-process GPU memory, power (NVML)")
def build(config: DaemonConfig) -> NvmlCollector:
    return NvmlCollector(max_processes=config.nvml.max_processes)
