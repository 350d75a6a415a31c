"""The daemon's collector registry and the wrapper that runs the collectors side by side.

- Every collector module registers itself (`@register`), and the flags, the config check and the docs table
  come from the registrations.
- A collector that hangs (a stand-in NVML whose memory query blocks, as a wedged driver does) costs only its
  own series: a real scrape of the real exporter answers within the deadline with every other collector's
  series, `memtel_collector_success{collector="nvml"}` is 0, and the hung call is not started again.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

import telemetry.daemon.collectors as collectors_package
from telemetry.cli import build_parser
from telemetry.cli import main as memtel_main
from telemetry.daemon.collectors import BY_NAME, NAMES, SPECS
from telemetry.daemon.collectors.meminfo import MeminfoCollector
from telemetry.daemon.collectors.nvml import NvmlCollector, NvmlReader
from telemetry.daemon.config import ConfigError, check_collectors, enabled_collectors, from_mapping
from telemetry.daemon.registry import DaemonCollectors
from telemetry.exporter import MetricsServer
from tests.daemon.helpers import parse_metrics
from tests.daemon.test_nvml_reader import NOT_SUPPORTED, stand_in_pynvml

ROOT = Path(__file__).parents[2]
PROC = ROOT / "tests" / "fixtures" / "proc"
DEADLINE = 0.5


def test_every_collector_module_registers_its_collector():
    """A module that defines a collector class (a `collect` method) and no registration is a forgotten one."""
    registered_modules = {spec.build.__module__ for spec in SPECS}
    unregistered = []
    for module_info in pkgutil.iter_modules(collectors_package.__path__):
        module = importlib.import_module(f"{collectors_package.__name__}.{module_info.name}")
        defines_collector = any(
            inspect.isclass(obj) and obj.__module__ == module.__name__ and callable(getattr(obj, "collect", None))
            for obj in vars(module).values())
        if defines_collector and module.__name__ not in registered_modules:
            unregistered.append(module.__name__)
    assert unregistered == [], f"collector modules without @register: {unregistered}"
    assert len(NAMES) == len(set(NAMES)) and tuple(spec.name for spec in SPECS) == NAMES
    assert [spec.order for spec in SPECS] == sorted(spec.order for spec in SPECS)


def test_the_docs_table_and_the_example_config_list_the_registry():
    text = (ROOT / "docs" / "metrics.md").read_text()
    table = text[text.index("| collector | what it reads |"):]
    rows = re.findall(r"^\| `([a-z_]+)` \| (.*) \|$", table[:table.index("\n\n")], re.MULTILINE)
    assert rows == [(spec.name, spec.help) for spec in SPECS], "docs/metrics.md's collector table != the registry"
    example = (ROOT / "configs" / "examples" / "daemon.yaml").read_text()
    listed = re.search(r"# Any of: ([a-z_, ]+)\.", example)
    assert listed and tuple(listed.group(1).split(", ")) == NAMES, "configs/examples/daemon.yaml's collector list"


def test_flags_and_config_accept_exactly_the_registered_names():
    parser = build_parser()
    daemon = next(a for a in parser._subparsers._group_actions[0].choices["daemon"]._actions  # type: ignore[union-attr]
                  if "--disable-collector" in a.option_strings)
    assert tuple(daemon.choices) == NAMES
    assert check_collectors(list(NAMES), "collectors.disabled") == NAMES
    with pytest.raises(ConfigError, match="unknown collector 'gpu'"):
        from_mapping({"collectors": {"disabled": ["gpu"]}})
    assert enabled_collectors(from_mapping({"collectors": {"disabled": ["nvml"]}})) == tuple(
        n for n in NAMES if n != "nvml")


def _check_config(tmp_path, capsys, *flags: str) -> tuple[int, str, str]:
    config = tmp_path / "daemon.yaml"
    config.write_text("collectors:\n  disabled: [nvml, processes]\n")
    code = memtel_main(["daemon", "--config", str(config), "--proc-root", str(_proc(tmp_path)), "--check-config",
                        *flags])
    out, err = capsys.readouterr()
    return code, out, err


def _proc(tmp_path: Path) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir(exist_ok=True)
    (proc / "meminfo").write_text((PROC / "meminfo.x86_64-debian12-24g").read_text())
    return proc


def test_enable_collector_turns_on_what_the_config_file_turns_off(tmp_path, capsys):
    code, out, _ = _check_config(tmp_path, capsys)
    assert code == 0 and "nvml" not in out and "processes" not in out
    code, out, _ = _check_config(tmp_path, capsys, "--enable-collector", "nvml")
    listed = out.split("collectors: ")[1].split(";")[0].split(", ")
    assert code == 0 and "nvml" in listed and "processes" not in listed


def test_enabling_and_disabling_one_collector_at_once_is_one_line(tmp_path, capsys):
    code, out, err = _check_config(tmp_path, capsys, "--enable-collector", "kmsg", "--disable-collector", "kmsg")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "--enable-collector and --disable-collector both name kmsg" in err


class _Hang:
    """Makes the stand-in NVML's memory query block until released, counting the calls that got there."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def install(self, monkeypatch) -> None:
        module = stand_in_pynvml(NOT_SUPPORTED)
        answer = module.nvmlDeviceGetMemoryInfo

        def hanging(handle):
            self.calls += 1
            self.release.wait(30)
            return answer(handle)

        module.nvmlDeviceGetMemoryInfo = hanging
        monkeypatch.setitem(sys.modules, "pynvml", module)


@pytest.fixture
def hung_nvml_exporter(monkeypatch):
    hang = _Hang()
    hang.install(monkeypatch)
    wrapper = DaemonCollectors({"meminfo": MeminfoCollector(str(PROC / "meminfo.x86_64-debian12-24g")),
                                "nvml": NvmlCollector(NvmlReader())}, deadline_seconds=DEADLINE)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(wrapper)
    server = MetricsServer("127.0.0.1", 0, registry, health=wrapper.health, name="memtel daemon test")
    server.start()
    try:
        yield f"http://127.0.0.1:{server.port}/metrics", hang, wrapper
    finally:
        hang.release.set()
        server.stop()


def _scrape(url: str) -> tuple[float, dict]:
    started = time.monotonic()
    text = httpx.get(url, timeout=10).text
    return time.monotonic() - started, parse_metrics(text)


def test_a_hung_collector_costs_only_its_own_series(hung_nvml_exporter):
    url, hang, wrapper = hung_nvml_exporter
    took, samples = _scrape(url)
    success = {dict(labels)["collector"]: value for (name, labels), value in samples.items()
               if name == "memtel_collector_success"}
    assert success == {"meminfo": 1.0, "nvml": 0.0}
    assert samples[("memtel_node_mem_total_bytes", ())] > 0      # the other collector's series are there
    assert not any(name.startswith("memtel_gpu_") for name, _ in samples)
    assert samples[("memtel_collector_failures_total", (("collector", "nvml"),))] == 1
    assert DEADLINE <= took < DEADLINE + 2.0, took
    assert hang.calls == 1

    # While the call hangs, later scrapes wait on that same call: NVML is not called again.
    took, samples = _scrape(url)
    assert samples[("memtel_collector_success", (("collector", "nvml"),))] == 0
    assert took < DEADLINE + 2.0 and hang.calls == 1
    health = wrapper.health()["collectors"]["nvml"]
    assert health["success"] is False and "did not answer within 0.5 s" in health["error"]

    # Once the driver answers, the late call is done with and the next scrape calls NVML again and succeeds.
    hang.release.set()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        _, samples = _scrape(url)
        if samples[("memtel_collector_success", (("collector", "nvml"),))] == 1:
            break
    assert samples[("memtel_collector_success", (("collector", "nvml"),))] == 1
    assert samples[("memtel_gpu_unified_memory", (("gpu", "0"), ("uuid", "GPU-7c2a1e5d")))] == 1
    assert hang.calls >= 2


def test_collectors_run_side_by_side():
    """Two collectors that each wait for the other to be running: they both succeed only side by side (one
    after another, the first would wait out the deadline)."""
    both_running = threading.Barrier(2)

    class Meets:
        def collect(self):
            both_running.wait(timeout=3)
            return []

    wrapper = DaemonCollectors({"a": Meets(), "b": Meets()}, deadline_seconds=5)
    families = wrapper.collect_sources()
    success = next(f for f in families if f.name == "memtel_collector_success")
    assert {s.labels["collector"]: s.value for s in success.samples} == {"a": 1.0, "b": 1.0}


def test_a_collector_that_raises_still_leaves_the_others_and_is_counted():
    class Broken:
        def collect(self):
            raise OSError("read failed")

    wrapper = DaemonCollectors({"broken": Broken(),
                                "meminfo": MeminfoCollector(str(PROC / "meminfo.x86_64-debian12-24g"))})
    names = [f.name for f in wrapper.collect_sources()]
    assert "memtel_node_mem_total_bytes" in names
    assert wrapper.health()["collectors"]["broken"] == {"success": False, "error": "OSError: read failed"}


def test_every_registered_collector_builds_from_the_default_config(tmp_path, monkeypatch):
    import psutil

    monkeypatch.setattr(psutil, "PROCFS_PATH", psutil.PROCFS_PATH)  # the processes collector sets it from proc_root
    config = from_mapping({"state_dir": str(tmp_path), "proc_root": str(_proc(tmp_path))})
    for name in enabled_collectors(config):
        built = BY_NAME[name].build(config)
        assert callable(getattr(built, "collect", None)), name


HANGING_PYNVML = '''
import time

class NVMLError(Exception):
    value = 0

NVML_ERROR_NOT_SUPPORTED = 3

def nvmlInit():
    pass

def nvmlSystemGetDriverVersion():
    return "580.142"

def nvmlDeviceGetCount():
    time.sleep(3600)  # a wedged driver: the call never returns
'''


@pytest.mark.slow  # the daemon's start and one 2 s deadline: about 4 s on the 2-core VM
def test_the_real_daemon_answers_and_stops_with_a_hung_nvml(tmp_path, monkeypatch):
    """`memtel daemon` with a stand-in NVML library whose device query never returns: every scrape answers
    within the deadline, NVML is the only collector that fails, and SIGTERM still stops it (exit 0)."""
    import os

    from tests.daemon.helpers import Daemon

    library = tmp_path / "lib"
    library.mkdir()
    (library / "pynvml.py").write_text(HANGING_PYNVML)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(library), os.environ.get("PYTHONPATH")])))
    daemon = Daemon(tmp_path / "state", "--disable-collector", "kmsg", "--disable-collector", "processes",
                    "--no-flight-recorder").start()
    try:
        started = time.monotonic()
        scrape = daemon.scrape()
        took = time.monotonic() - started
        assert scrape.value("memtel_collector_success", collector="nvml") == 0
        assert scrape.value("memtel_collector_success", collector="meminfo") == 1
        assert scrape.value("memtel_node_mem_total_bytes") > 0
        assert took < 2.0 + 3.0, took
        health = httpx.get(daemon.url + "/healthz", timeout=5).json()
        assert "did not answer within 2 s" in health["collectors"]["nvml"]["error"]
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_collector_workers_end_when_idle_and_start_again():
    from telemetry.daemon.registry import _Workers

    workers = _Workers(2)
    workers.IDLE_SECONDS = 0.1  # type: ignore[misc]
    done = [threading.Event() for _ in range(3)]
    workers.submit(done[0].set)
    workers.submit(done[1].set)
    assert all(event.wait(5) for event in done[:2])
    deadline = time.monotonic() + 5
    while workers._threads and time.monotonic() < deadline:
        time.sleep(0.02)
    assert workers._threads == 0  # no thread is left waiting once idle
    workers.submit(done[2].set)
    assert done[2].wait(5) and workers._threads <= 2
