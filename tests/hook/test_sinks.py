"""The sinks: the JSONL log (complete after SIGTERM, bounded, exact format) and the lazy exporter."""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import telemetry
from telemetry.hook.jsonl_sink import JsonlConfig, JsonlSink, RecordFormatter, format_record
from tests.support.ports import free_port, free_port_block

ROOT = Path(__file__).resolve().parents[2]

# A child process: hooks a function, calls it N times, says "ready", then waits to be killed.
CHILD = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
import telemetry
mode, calls = sys.argv[3], int(sys.argv[4])
if mode == "host-handler":
    def on_term(signum, frame):
        open(os.path.join(sys.argv[2], "host-handler-ran"), "w").write("yes")
        sys.exit(3)
    signal.signal(signal.SIGTERM, on_term)
handle = telemetry.install(["child_mod:f"], port=None, log_dir=sys.argv[2],
                           flush_interval_s=3600, flush_records=10**9)  # only exit/SIGTERM flush
import child_mod
for i in range(calls):
    child_mod.f(i)
print("ready", flush=True)
time.sleep(60)
"""


def _run_child(tmp_path: Path, mode: str, calls: int) -> tuple[subprocess.Popen, Path]:
    (tmp_path / "child_mod.py").write_text("def f(x):\n    return x\n")
    log_dir = tmp_path / "logs"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(log_dir), mode, str(calls)],
                             cwd=ROOT, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert child.stdout.readline().strip() == "ready"
    return child, log_dir


@pytest.mark.parametrize("mode, expected_status", [("default", -signal.SIGTERM), ("host-handler", 3)])
def test_every_record_reaches_the_log_after_sigterm(tmp_path, mode, expected_status):
    calls = 3000
    child, log_dir = _run_child(tmp_path, mode, calls)
    try:
        files = list(log_dir.glob("*.jsonl"))
        assert not files or files[0].stat().st_size == 0  # nothing flushed before the signal
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == expected_status  # the host's handling is unchanged
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    files = list(log_dir.glob("*.jsonl"))
    assert [f.name for f in files] == [f"memtel-calls-rank0-pid{child.pid}.jsonl"]
    records = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert [r["call"] for r in records] == list(range(calls))
    assert {r["site"] for r in records} == {"child_mod:f"} and {r["pid"] for r in records} == {child.pid}
    assert (tmp_path / "logs" / "host-handler-ran").exists() == (mode == "host-handler")


def test_every_record_reaches_the_log_at_normal_exit(tmp_path):
    (tmp_path / "exit_mod.py").write_text("def f(x):\n    return x\n")
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r})\nimport telemetry\n"
            f"telemetry.install(['exit_mod:f'], port=None, log_dir={str(tmp_path)!r}, flush_interval_s=3600,"
            " flush_records=10**9)\nimport exit_mod\n[exit_mod.f(i) for i in range(1234)]\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    (log,) = tmp_path.glob("memtel-calls-*.jsonl")
    assert len(log.read_text().splitlines()) == 1234


def test_a_full_queue_drops_and_counts_instead_of_blocking(make_module, tmp_path):
    from prometheus_client import CollectorRegistry

    name = make_module("def f(x):\n    return x\n")
    module = importlib.import_module(name)
    registry = CollectorRegistry()
    handle = telemetry.install([f"{name}:f"], port=None, log_dir=tmp_path, registry=registry, max_queue=10,
                               flush_interval_s=3600, flush_records=10**9)
    for i in range(100):
        module.f(i)
    node = socket.gethostname()
    assert registry.get_sample_value("memtel_hook_log_dropped_records_total", {"rank": "0", "node": node}) == 90
    assert registry.get_sample_value("memtel_hook_calls_total", {"site": f"{name}:f", "rank": "0",
                                                                 "node": node}) == 100
    handle.flush()
    records = [json.loads(line) for line in Path(handle.log_path).read_text().splitlines()]
    assert [r["call"] for r in records] == list(range(10))


def test_writer_flushes_on_the_time_bound_without_exit(make_module, tmp_path):
    name = make_module("def f(x):\n    return x\n")
    module = importlib.import_module(name)
    handle = telemetry.install([f"{name}:f"], port=None, log_dir=tmp_path, flush_interval_s=0.2)
    for i in range(5):
        module.f(i)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        path = Path(handle.log_path)
        if path.exists() and len(path.read_text().splitlines()) == 5:
            break
        time.sleep(0.05)
    assert len(Path(handle.log_path).read_text().splitlines()) == 5


@pytest.mark.parametrize("item", [
    (1795000000_250000000, 0, "pkg.mod:f", "cuda:0", (1 << 30, 5, 7, 1, 0, 0), 123 << 20, 0, None),
    (1795000000_500000000, 9, "pkg.mod:Class.m", "cpu", None, 4096, 8192, [4, 7]),
    (1795000001_000000000, 2, 'odd"site\\name%d', "sim", (0, 0, 0, 0, 0, 0), None, 5, [1, 1]),
    (1795000001_000000123, 3, 'odd"site\\name%d', "sim", (0, 0, 0, 0, 0, 0), 7, 5, None),
    (1795000002_999999999, 4, "pkg.mod:f", "cpu", None, 4096, 8192, None),
])
def test_fast_formatter_writes_exactly_the_reference_json(item):
    fast = RecordFormatter(rank=3, pid=77, node="node-1")
    line = fast(*item)
    assert line.endswith("}\n") and line.count("\n") == 1
    reference = format_record((item[0] / 1e9, *item[1:]), 3, 77, "node-1")
    parsed, expected = json.loads(line), json.loads(reference)
    assert type(parsed["ts"]) is float and parsed.pop("ts") == pytest.approx(expected.pop("ts"), abs=1e-6)
    assert parsed == expected
    assert list(parsed) == list(expected)  # key order too


def _reference_lines(records, rank, pid, node):
    return [json.loads(format_record((r[0] / 1e9, *r[1:]), rank, pid, node)) for r in records]


def _written(sink):
    lines = [json.loads(line) for line in Path(sink.path).read_text().splitlines()]
    for line in lines:
        line["ts"] = round(line["ts"], 6)
    return lines


def test_the_sinks_fast_path_writes_every_record_exactly_as_the_reference(tmp_path):
    # Values that repeat, change, come back, lose their allocator, change device and carry a shape:
    # each cached part (SiteLine) must be reused only while its values are equal.
    a, b = (1 << 30, 5, 7, 1, 0, 0), (1 << 31, 6, 8, 1, 0, 0)
    t = 1795000000_000000000
    records = [(t + 1, 0, "m:f", "cuda:0", a, 100 << 10, 0, None),
               (t + 2, 1, "m:f", "cuda:0", a, 100 << 10, 0, None),      # all repeated
               (t + 3, 2, "m:f", "cuda:0", b, 100 << 10, 0, None),      # allocator changed
               (t + 4, 3, "m:f", "cuda:0", b, 96 << 10, 4096, None),    # host changed
               (t + 5, 4, "m:f", "cuda:0", a, 96 << 10, 4096, None),    # allocator back to a
               (t + 6, 5, "m:g", "cuda:0", a, 96 << 10, 4096, None),    # another site, same values
               (t + 7, 6, "m:f", "cpu", None, 96 << 10, 4096, None),    # no allocator, other device
               (t + 8, 7, "m:f", "cuda:0", a, 96 << 10, 4096, [3, 4]),  # with a shape
               (t + 9, 8, "m:f", "cuda:0", a, None, 4096, None),        # host value absent
               (t + 10, 9, "m:f", "cuda:0", b, 96 << 10, 4096, None)]
    sink = JsonlSink(JsonlConfig(str(tmp_path)), node="node-1")
    sink.open(rank=2)
    for record in records:
        sink.push(*record)
    sink.close()
    expected = _reference_lines(records, 2, os.getpid(), "node-1")
    for line in expected:
        line["ts"] = round(line["ts"], 6)
    assert _written(sink) == expected


def test_threads_recording_one_site_never_mix_their_values(tmp_path):
    import threading

    sink = JsonlSink(JsonlConfig(str(tmp_path), max_queue=10 ** 6), node="n")
    sink.open(rank=0)
    threads_n, per_thread = 4, 3000

    def run(k):
        for i in range(per_thread):
            v = (k + i) % 3   # values shared by the threads, repeating, so the cached parts are reused
            sink.push(time.time_ns(), v, "m:f", "cuda:0", (v, v, v, v, v, v), v << 10, v << 10)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(threads_n)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # switch threads as often as the interpreter allows
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    sink.close()
    lines = [json.loads(line) for line in Path(sink.path).read_text().splitlines()]
    assert len(lines) == threads_n * per_thread
    for line in lines:   # every field of a line shows the values of the record it was written for
        v = line["call"]
        assert [line[f] for f in ("reserved_bytes", "allocated_bytes", "num_device_alloc", "num_device_free",
                                  "num_alloc_retries", "num_ooms")] == [v] * 6
        assert line["mem_available_bytes"] == line["swap_free_bytes"] == v << 10


def test_log_file_name_has_rank_and_pid(tmp_path):
    sink = JsonlSink(JsonlConfig(str(tmp_path)), node="n")
    sink.open(rank=5)
    sink.push(time.time_ns(), 0, "a:b", "cpu", None, 1, 2, None)
    sink.close()
    assert [p.name for p in tmp_path.iterdir()] == [f"memtel-calls-rank5-pid{os.getpid()}.jsonl"]


def test_a_record_pushed_before_open_is_written_after_it(tmp_path):
    sink = JsonlSink(JsonlConfig(str(tmp_path)), node="n")
    sink.push(time.time_ns(), 0, "a:b", "cpu", None, 1, 2, None)  # another thread's first call, mid-open
    sink.open(rank=0)
    sink.push(time.time_ns(), 1, "a:b", "cpu", None, 1, 2, None)
    sink.close()
    records = [json.loads(line) for line in Path(sink.path).read_text().splitlines()]
    assert [r["call"] for r in records] == [0, 1] and records[0]["pid"] == os.getpid()


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_exporter_starts_only_at_the_first_hooked_call_on_port_plus_local_rank(tmp_path):
    base = free_port_block(3)
    (tmp_path / "rank_mod.py").write_text("def f(x):\n    return x\n")
    code = (f"import sys, time; sys.path.insert(0, {str(tmp_path)!r})\nimport telemetry\n"
            f"telemetry.install(['rank_mod:f'], port={base}, addr='127.0.0.1')\n"
            "print('installed', flush=True); sys.stdin.readline()\n"
            "import rank_mod; rank_mod.f(1); rank_mod.f(2)\n"
            "print('called', flush=True); sys.stdin.readline()\n")
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(ROOT), "LOCAL_RANK": "2",
                                             "RANK": "6"})
    try:
        assert child.stdout.readline().strip() == "installed"
        assert not any(_listening(base + i) for i in range(3))  # installed, nothing called: no exporter
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "called"
        assert not _listening(base) and not _listening(base + 1)
        text = httpx.get(f"http://127.0.0.1:{base + 2}/metrics", timeout=5).text
        line = next(x for x in text.splitlines() if x.startswith("memtel_hook_calls_total{"))
        assert 'site="rank_mod:f"' in line and 'rank="6"' in line and line.endswith(" 2.0")
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_taken_exporter_port_is_counted_and_the_log_still_works(make_module, tmp_path):
    from prometheus_client import CollectorRegistry

    name = make_module("def f(x):\n    return x\n")
    module = importlib.import_module(name)
    port = free_port()
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", port))
    blocker.listen()
    try:
        registry = CollectorRegistry()
        handle = telemetry.install([f"{name}:f"], port=port, addr="127.0.0.1", log_dir=tmp_path, registry=registry)
        assert module.f(4) == 4 and module.f(5) == 5
        handle.flush()
        assert len(Path(handle.log_path).read_text().splitlines()) == 2
        assert registry.get_sample_value("memtel_hook_errors_total", {"site": "", "stage": "exporter", "rank": "0",
                                                                      "node": socket.gethostname()}) == 1
        assert handle.exporter_port is None
    finally:
        blocker.close()


def test_every_record_reaches_the_log_in_a_multiprocessing_child(tmp_path):
    # multiprocessing children leave through os._exit: atexit does not run there.
    (tmp_path / "mp_mod.py").write_text("def f(x):\n    return x\n")
    code = (
        "import multiprocessing, sys\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "def child():\n"
        "    import telemetry, mp_mod\n"
        f"    telemetry.install(['mp_mod:f'], port=None, log_dir={str(tmp_path)!r}, flush_interval_s=3600,\n"
        "                      flush_records=10**9)\n"
        "    for i in range(777):\n"
        "        mp_mod.f(i)\n"
        "if __name__ == '__main__':\n"
        "    p = multiprocessing.get_context('fork').Process(target=child)\n"
        "    p.start(); p.join(); sys.exit(p.exitcode)\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    (log,) = tmp_path.glob("memtel-calls-*.jsonl")
    assert len(log.read_text().splitlines()) == 777


def test_a_forked_child_logs_its_own_calls_and_still_dies_by_sigterm(tmp_path):
    # The parent records first (installing the SIGTERM flush); the forked child inherits the handler.
    (tmp_path / "fork_mod.py").write_text("def f(x):\n    return x\n")
    code = (
        "import os, signal, sys, time\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "import telemetry, fork_mod\n"
        f"telemetry.install(['fork_mod:f'], port=None, log_dir={str(tmp_path)!r}, flush_interval_s=3600,\n"
        "                  flush_records=10**9)\n"
        "[fork_mod.f(i) for i in range(10)]\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    [fork_mod.f(i) for i in range(25)]\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
        "    os._exit(7)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, pid)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    died_by_sigterm, child_pid = out.stdout.split()
    assert died_by_sigterm == "True"
    logs = {p.name: [json.loads(line) for line in p.read_text().splitlines()] for p in tmp_path.glob("*.jsonl")}
    child = logs.pop(f"memtel-calls-rank0-pid{child_pid}.jsonl")
    assert [r["call"] for r in child] == list(range(25))          # its own index, from 0
    (parent,) = logs.values()
    assert [r["call"] for r in parent] == list(range(10))
