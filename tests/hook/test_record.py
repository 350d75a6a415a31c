"""The record path: pass-through, errors counted not raised, Prometheus values, growth, threads."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

import telemetry
from telemetry.hook import set_allocator_source
from telemetry.hook.record import shape_of
from telemetry.hook.state import RESERVED_DELTA_BUCKETS
from telemetry.procfs.meminfo import MeminfoReader, parse_meminfo
from telemetry.procfs.meminfo import parse_available_and_swap_free as available_and_swap_free

ROOT = Path(__file__).resolve().parents[2]
NODE = socket.gethostname()
SOURCE = """
class Boom(Exception):
    pass

def identity(x):
    return x

def fail(error):
    raise error
"""


def labels(site, **extra):
    return {"site": site, "rank": "0", "node": NODE, **extra}


class FakeAllocator:
    """An allocator source (the contract of set_allocator_source) whose values a test drives."""

    def __init__(self):
        self.values = dict(reserved_bytes=0, allocated_bytes=0, num_device_alloc=0, num_device_free=0,
                           num_alloc_retries=0, num_ooms=0)

    def grow(self, nbytes):
        self.values["reserved_bytes"] += nbytes
        self.values["allocated_bytes"] += nbytes
        self.values["num_device_alloc"] += 1

    def __call__(self):
        return dict(self.values)


def test_result_and_exceptions_pass_through_unchanged(make_module, tmp_path):
    name = make_module(SOURCE)
    module = importlib.import_module(name)
    registry = CollectorRegistry()
    telemetry.install([f"{name}:identity", f"{name}:fail"], port=None, registry=registry, log_dir=tmp_path)
    payload = object()
    assert module.identity(payload) is payload
    error = module.Boom("boom")
    with pytest.raises(module.Boom) as raised:
        module.fail(error)
    assert raised.value is error
    # The failed call is recorded too: an OOM raised by the hooked function is worth a record.
    assert registry.get_sample_value("memtel_hook_calls_total", labels(f"{name}:fail")) == 1
    assert registry.get_sample_value("memtel_hook_errors_total", labels(f"{name}:fail", stage="allocator")) is None


def test_errors_inside_telemetry_are_counted_never_raised(make_module):
    name = make_module(SOURCE)
    module = importlib.import_module(name)
    registry = CollectorRegistry()
    telemetry.install([f"{name}:identity"], port=None, registry=registry)

    def broken_source():
        raise RuntimeError("allocator source exploded")

    set_allocator_source(broken_source)
    assert module.identity(3) == 3
    assert module.identity(4) == 4
    assert registry.get_sample_value("memtel_hook_errors_total",
                                     labels(f"{name}:identity", stage="allocator")) == 2
    set_allocator_source(lambda: {"reserved_bytes": 1})  # missing keys: a KeyError inside the hook
    assert module.identity(5) == 5
    assert registry.get_sample_value("memtel_hook_errors_total",
                                     labels(f"{name}:identity", stage="allocator")) == 3


def test_registry_values_follow_the_allocator_and_the_host(make_module):
    name = make_module(SOURCE)
    module = importlib.import_module(name)
    site = f"{name}:identity"
    fake = FakeAllocator()
    set_allocator_source(fake)
    registry = CollectorRegistry()
    telemetry.install([site], port=None, registry=registry)  # baseline read here: all zero
    growth_calls = [1, 2, 5]
    sizes = {1: 2 << 20, 2: 64 << 20, 5: 3 << 30}
    for call in range(7):
        if call in growth_calls:
            fake.grow(sizes[call])
        before = parse_meminfo(Path("/proc/meminfo").read_text())["MemAvailable"]
        module.identity(call)
        after = parse_meminfo(Path("/proc/meminfo").read_text())["MemAvailable"]
        value = registry.get_sample_value("memtel_hook_host_mem_available_bytes", labels(site))
        assert value is not None
        assert min(before, after) - (64 << 20) <= value <= max(before, after) + (64 << 20)
    get = lambda metric, **kw: registry.get_sample_value(metric, labels(site, **kw))
    assert get("memtel_hook_calls_total") == 7
    assert get("memtel_hook_growth_events_total") == len(growth_calls)
    assert get("memtel_allocator_reserved_bytes") == sum(sizes.values())
    assert get("memtel_allocator_allocated_bytes") == sum(sizes.values())
    assert get("memtel_allocator_device_alloc_total") == 3
    assert get("memtel_allocator_device_free_total") == 0
    assert get("memtel_allocator_ooms_total") == 0
    assert get("memtel_allocator_alloc_retries_total") == 0
    assert get("memtel_hook_host_swap_free_bytes") is not None
    # Histogram of the per-call reserved delta: four calls with 0, one each of 2 MiB, 64 MiB, 3 GiB.
    assert get("memtel_hook_reserved_delta_bytes_count") == 7
    assert get("memtel_hook_reserved_delta_bytes_sum") == sum(sizes.values())
    assert get("memtel_hook_reserved_delta_bytes_bucket", le="0.0") == 4
    assert get("memtel_hook_reserved_delta_bytes_bucket", le=str(float(2 << 20))) == 5
    assert get("memtel_hook_reserved_delta_bytes_bucket", le=str(float(64 << 20))) == 6
    assert get("memtel_hook_reserved_delta_bytes_bucket", le=str(float(RESERVED_DELTA_BUCKETS[-1]))) == 7
    assert get("memtel_hook_reserved_delta_bytes_bucket", le="+Inf") == 7


def test_allocator_series_are_absent_without_an_allocator(make_module):
    name = make_module(SOURCE)
    module = importlib.import_module(name)
    registry = CollectorRegistry()
    # No allocator to read, wherever this runs (on the GPU machine CUDA may be initialized already).
    set_allocator_source(lambda: None)
    try:
        telemetry.install([f"{name}:identity"], port=None, registry=registry)
        module.identity(1)
    finally:
        set_allocator_source(None)
    site = f"{name}:identity"
    assert registry.get_sample_value("memtel_hook_calls_total", labels(site)) == 1
    assert (registry.get_sample_value("memtel_hook_host_mem_available_bytes", labels(site)) or 0) > 0
    for metric in ("memtel_allocator_reserved_bytes", "memtel_allocator_device_alloc_total",
                   "memtel_hook_growth_events_total", "memtel_hook_reserved_delta_bytes_count"):
        assert registry.get_sample_value(metric, labels(site)) is None, metric


def test_calls_from_many_threads_are_all_counted_and_logged_once(make_module, tmp_path):
    name = make_module(SOURCE)
    module = importlib.import_module(name)
    registry = CollectorRegistry()
    handle = telemetry.install([f"{name}:identity"], port=None, registry=registry, log_dir=tmp_path)
    threads, per_thread = 8, 500
    barrier = threading.Barrier(threads)

    def work():
        barrier.wait()
        for i in range(per_thread):
            module.identity(i)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    handle.flush()
    assert registry.get_sample_value("memtel_hook_calls_total", labels(f"{name}:identity")) == threads * per_thread
    records = [json.loads(line) for line in Path(handle.log_path).read_text().splitlines()]
    assert sorted(r["call"] for r in records) == list(range(threads * per_thread))


def test_shape_summary_of_the_first_tensor_argument(make_module, tmp_path):
    torch = pytest.importorskip("torch")
    assert shape_of((torch.empty(7, 3, 5), torch.empty(2)), {}) == [7, 15]
    assert shape_of(((torch.empty(4, 8), torch.empty(4)), torch.empty(1)), {}) == [4, 8]  # (q, scale)
    assert shape_of((1, "x"), {"q": torch.empty(6, 2)}) == [6, 2]
    assert shape_of((1, 2), {}) is None
    name = make_module(SOURCE)
    module = importlib.import_module(name)
    handle = telemetry.install([f"{name}:identity"], port=None, log_dir=tmp_path, record_shape=True)
    module.identity(torch.empty(9, 4))
    handle.flush()
    assert json.loads(Path(handle.log_path).read_text())["shape"] == [9, 4]


def test_fast_meminfo_fields_match_the_parser():
    data = MeminfoReader().read_bytes()
    parsed = parse_meminfo(data.decode())
    available, swap_free = available_and_swap_free(data)
    # The kernel regenerates the file per read; the same text must give the same numbers.
    assert available == parsed["MemAvailable"] and swap_free == parsed["SwapFree"]
    fixture_dir = ROOT / "tests" / "fixtures" / "proc"
    for path in sorted(fixture_dir.glob("meminfo*")):
        fixture = parse_meminfo(path.read_text())
        assert available_and_swap_free(path.read_bytes()) == (fixture.get("MemAvailable"), fixture.get("SwapFree"))
    assert available_and_swap_free(b"MemTotal: 1 kB\n") == (None, None)


def _meminfo_texts() -> list[str]:
    """Real texts, and the same moved, widened and cut: where the fields are must never matter."""
    base = MeminfoReader().read_text()
    fixtures = [p.read_text() for p in sorted((ROOT / "tests" / "fixtures" / "proc").glob("meminfo*"))]
    return [base, *fixtures,
            base.replace("MemTotal:", "MemTotal:" + " " * 50),     # SwapFree 50 characters later
            base.replace("MemTotal:", "MemTotal:" + " " * 500),    # far later
            "MemAvailable:\t7 kB\nSwapFree:       9 kB\n",       # a tab, and both before where they were
            "MemAvailable:  7 kB\n",                              # no SwapFree
            "MemTotal: 1 kB\n",                                   # neither
            "MemAvailable: 123456789012345678901234 kB\nSwapFree: 18014398509481983 kB\n",  # past 64 bits
            ""]


def test_compiled_meminfo_reader_gives_the_python_parsers_answers(tmp_path):
    if not MeminfoReader().compiled:
        pytest.skip("telemetry.procfs._meminfo_speedups is not built (no C compiler at install)")
    path = tmp_path / "meminfo"
    path.write_text("")
    compiled, python = MeminfoReader(str(path)), MeminfoReader(str(path), compiled=False)
    assert compiled.compiled and not python.compiled
    for text in _meminfo_texts():
        path.write_text(text)   # the same file (inode): the kept descriptors read the new text
        expected = available_and_swap_free(text.encode())
        assert compiled.available_and_swap_free() == python.available_and_swap_free() == expected, text[:80]
    for bad in ("MemAvailable: lots kB\n", "MemAvailable: 12 MB\n", "MemAvailable: 12"):
        path.write_text(bad)
        for reader in (compiled, python):
            with pytest.raises(ValueError):
                reader.available_and_swap_free()


def test_the_hooks_meminfo_reader_reads_the_real_proc_meminfo():
    # Whichever path is built, on the real file: SwapFree is steady here, MemAvailable moves a little.
    available, swap_free = MeminfoReader().available_and_swap_free()
    parsed = parse_meminfo(Path("/proc/meminfo").read_text())
    assert swap_free == parsed["SwapFree"] and available is not None
    assert abs(available - parsed["MemAvailable"]) <= 0.05 * parsed["MemAvailable"]


def test_the_compiled_meminfo_reader_is_built_where_a_compiler_exists():
    # setup.py marks the extension optional: a broken build would silently leave only Python.
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the pure-Python reader is the expected one")
    assert MeminfoReader().compiled, "a C compiler exists but _meminfo_speedups was not built (pip install -e .)"


def test_a_meminfo_read_error_is_counted_and_the_next_call_reopens(tmp_path):
    from telemetry.hook.record import Recorder
    from telemetry.hook.state import HookState
    from telemetry.hook.targets import parse_target

    path = tmp_path / "meminfo"
    path.write_text("MemAvailable: 7 kB\nSwapFree: 9 kB\n")
    reader = MeminfoReader(str(path))
    state = HookState(node="n", targets={}, started=True)
    recorder = Recorder(state, None, reader, record_shape=False, on_first_record=lambda: None)
    call = recorder.wrap(lambda: None, parse_target("m:t"))
    call()
    os.close(reader.fileno())   # the kept descriptor goes bad under the reader
    call()
    path.write_text("MemAvailable: 8 kB\nSwapFree: 9 kB\n")
    call()
    assert state.errors == {("m:t", "meminfo"): 1}
    site = state.sites["m:t"]
    assert site.calls == 2 and site.mem_available_bytes == 8 << 10 and site.swap_free_bytes == 9 << 10


def test_torch_compile_traces_through_without_recording_or_graph_breaks(make_module):
    torch = pytest.importorskip("torch")
    name = make_module("def scale(x):\n    return x * 2\n")
    module = importlib.import_module(name)
    registry = CollectorRegistry()
    telemetry.install([f"{name}:scale"], port=None, registry=registry)
    site = f"{name}:scale"

    def model(x):
        return module.scale(x) + 1

    explanation = torch._dynamo.explain(model)(torch.ones(3))
    assert explanation.graph_break_count == 0
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 3.0))
    assert registry.get_sample_value("memtel_hook_calls_total", labels(site)) is None  # traced, not recorded
    assert torch.equal(model(torch.ones(3)), torch.full((3,), 3.0))                   # eager: recorded
    assert registry.get_sample_value("memtel_hook_calls_total", labels(site)) == 1


def test_hook_never_imports_torch_into_a_process_without_it(tmp_path):
    (tmp_path / "plain_mod.py").write_text("def f(x):\n    return x + 1\n")
    code = (
        "import sys, json\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "import telemetry\n"
        f"h = telemetry.install(['plain_mod:f'], port=None, log_dir={str(tmp_path)!r})\n"
        "import plain_mod\n"
        "assert plain_mod.f(1) == 2\n"
        "h.flush()\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'log': open(h.log_path).read()}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["torch"] is False
    record = json.loads(result["log"])
    assert record["device"] == "cpu" and "reserved_bytes" not in record and record["mem_available_bytes"] > 0


def test_a_reserved_decrease_is_observed_as_zero_growth(make_module):
    name = make_module(SOURCE)
    module = importlib.import_module(name)
    site = f"{name}:identity"
    fake = FakeAllocator()
    fake.grow(64 << 20)
    set_allocator_source(fake)
    registry = CollectorRegistry()
    telemetry.install([site], port=None, registry=registry)
    fake.values["reserved_bytes"] = 0  # empty_cache between calls
    fake.values["num_device_free"] = 1
    module.identity(1)
    get = lambda metric, **kw: registry.get_sample_value(metric, labels(site, **kw))
    assert get("memtel_hook_reserved_delta_bytes_bucket", le="0.0") == 1
    assert get("memtel_hook_reserved_delta_bytes_sum") == 0
    assert get("memtel_hook_growth_events_total") == 0
    assert get("memtel_allocator_device_free_total") == 1
    assert get("memtel_allocator_reserved_bytes") == 0
