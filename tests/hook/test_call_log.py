"""The call log (JSONL, one line per hooked call): its one line format, the writer, and the log on disk.

Complete after SIGTERM, at exit and in multiprocessing and forked children; bounded; exact format; and
(issue 16) opened like every memtel file, and harmless on a full disk.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

import telemetry
from telemetry.allocator_counters import FIELDS, AllocatorCounters
from telemetry.hook.line_format import SiteLine
from telemetry.hook.log_writer import CallLogWriter, log_file_name
from telemetry.hook.state import HookState

ROOT = Path(__file__).resolve().parents[2]
NODE = socket.gethostname()
KEYS = ["ts", "call", "site", "rank", "pid", "node", "device", *FIELDS, "mem_available_bytes", "swap_free_bytes"]

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


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.mark.parametrize("mode, expected_status", [("default", -signal.SIGTERM), ("host-handler", 3)])
def test_every_record_reaches_the_log_after_sigterm(tmp_path, mode, expected_status):
    calls = 3000
    (tmp_path / "child_mod.py").write_text("def f(x):\n    return x\n")
    log_dir = tmp_path / "logs"
    with subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(log_dir), mode, str(calls)],
                          cwd=ROOT, stdout=subprocess.PIPE, text=True, env=child_env()) as child:
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            files = list(log_dir.glob("*.jsonl"))
            assert [f.stat().st_size for f in files] == [0]  # created at the first call, nothing flushed yet
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
    assert (log_dir / "host-handler-ran").exists() == (mode == "host-handler")


# A SIGTERM between a main-thread flush taking its lines and writing them: a pool worker flushing at its
# exit when Pool.terminate() signals it (CI lost a worker's three records that way).
INTERRUPTED_FLUSH = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import telemetry
from telemetry.hook import session
handle = telemetry.install(["child_mod:f"], port=None, log_dir=sys.argv[2], flush_interval_s=3600,
                           flush_records=10**9)
import child_mod
for i in range(int(sys.argv[3])):
    child_mod.f(i)
writer = session._session.recorder.log
write = writer._write
def interrupted(lines):
    os.kill(os.getpid(), signal.SIGTERM)   # the handler runs here, on this thread, before the lines are written
    write(lines)
writer._write = interrupted
handle.flush()
print("the process went on after SIGTERM", flush=True)
"""


def test_a_sigterm_in_the_middle_of_a_flush_on_the_same_thread_loses_nothing_and_still_ends_it(tmp_path):
    calls = 500
    (tmp_path / "child_mod.py").write_text("def f(x):\n    return x\n")
    log_dir = tmp_path / "logs"
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_FLUSH, str(tmp_path), str(log_dir), str(calls)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, env=child_env())
    assert done.returncode == -signal.SIGTERM and "went on" not in done.stdout   # ended the way it would have
    (log,) = log_dir.glob("*.jsonl")
    assert [json.loads(line)["call"] for line in log.read_text().splitlines()] == list(range(calls))


def test_every_record_reaches_the_log_at_normal_exit(tmp_path):
    (tmp_path / "exit_mod.py").write_text("def f(x):\n    return x\n")
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r})\nimport telemetry\n"
            f"telemetry.install(['exit_mod:f'], port=None, log_dir={str(tmp_path)!r}, flush_interval_s=3600,"
            " flush_records=10**9)\nimport exit_mod\n[exit_mod.f(i) for i in range(1234)]\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60, env=child_env())
    (log,) = tmp_path.glob("memtel-calls-*.jsonl")
    assert len(log.read_text().splitlines()) == 1234


def test_a_full_queue_drops_and_counts_instead_of_blocking(make_module, tmp_path):
    name = make_module("def f(x):\n    return x\n")
    module = importlib.import_module(name)
    registry = CollectorRegistry()
    handle = telemetry.install([f"{name}:f"], port=None, log_dir=tmp_path, registry=registry, max_queue=10,
                               flush_interval_s=3600, flush_records=10**9)
    for i in range(100):
        module.f(i)
    dropped = {reason: registry.get_sample_value("memtel_hook_log_dropped_records_total",
                                                 {"reason": reason, "rank": "0", "node": NODE})
               for reason in ("queue_full", "write_failed")}
    assert dropped == {"queue_full": 90, "write_failed": 0}
    assert registry.get_sample_value("memtel_hook_calls_total", {"site": f"{name}:f", "rank": "0",
                                                                 "node": NODE}) == 100
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


def expected_record(ts_ns, call, site, device, allocator, available, swap_free, shape, *, rank, pid, node):
    """What a line must say, built field by field from the record's meaning (docs/architecture.md)."""
    record = {"ts": ts_ns / 1e9, "call": call, "site": site, "rank": rank, "pid": pid, "node": node, "device": device}
    if allocator is not None:
        record.update(AllocatorCounters(*allocator).as_dict())
    record.update(mem_available_bytes=available, swap_free_bytes=swap_free)
    if shape is not None:
        record["shape"] = shape
    return record


def parse_line(line: str) -> dict:
    assert line.endswith("}\n") and line.count("\n") == 1
    record = json.loads(line)
    assert type(record["ts"]) is float
    return record


def assert_same(parsed: dict, expected: dict) -> None:
    assert list(parsed) == list(expected)  # key order too
    assert parsed.pop("ts") == pytest.approx(expected.pop("ts"), abs=1e-6)
    assert parsed == expected


@pytest.mark.parametrize("item", [
    (1795000000_250000000, 0, "pkg.mod:f", "cuda:0", (1 << 30, 5, 7, 1, 0, 0), 123 << 20, 0, None),
    (1795000000_500000000, 9, "pkg.mod:Class.m", "cpu", None, 4096, 8192, [4, 7]),
    (1795000001_000000000, 2, 'odd"site\\name%d', "sim", (0, 0, 0, 0, 0, 0), None, 5, [1, 1]),
    (1795000001_000000123, 3, 'odd"site\\name%d', "sim", (0, 0, 0, 0, 0, 0), 7, 5, None),
    (1795000002_999999999, 4, "pkg.mod:f", "cpu", None, 4096, 8192, None),
    (1795000003_000000001, 5, "pkg.mod:f", "cuda:1", (1 << 40, 1 << 39, 10**6, 10**6 - 3, 2, 1), None, None, None),
])
def test_the_line_format_writes_each_field_as_documented(item):
    ts_ns, call, site, device, allocator, available, swap_free, shape = item
    line = SiteLine(site, device, rank=3, pid=77, node="node-1")
    counters = None if allocator is None else AllocatorCounters(*allocator)
    parsed = parse_line(line.format(ts_ns, call, counters, available, swap_free, shape))
    expected = expected_record(*item, rank=3, pid=77, node="node-1")
    assert list(parsed) == [k for k in KEYS if k in expected] + (["shape"] if shape is not None else [])
    assert_same(parsed, expected)


def test_a_site_line_reuses_its_parts_only_while_their_values_are_equal():
    # Values that repeat, change, come back, lose their allocator and carry a shape: each cached part
    # must be reused only while its values are equal (equal values in another object too).
    a, b = AllocatorCounters(1 << 30, 5, 7, 1, 0, 0), AllocatorCounters(1 << 31, 6, 8, 1, 0, 0)
    t = 1795000000_000000000
    records = [(t + 1, 0, a, 100 << 10, 0, None),
               (t + 2, 1, a, 100 << 10, 0, None),                            # all repeated
               (t + 3, 2, b, 100 << 10, 0, None),                            # allocator changed
               (t + 4, 3, b, 96 << 10, 4096, None),                          # host changed
               (t + 5, 4, AllocatorCounters(*a), 96 << 10, 4096, None),      # equal to a, another object
               (t + 6, 5, None, 96 << 10, 4096, None),                       # no allocator
               (t + 7, 6, a, 96 << 10, 4096, [3, 4]),                        # with a shape
               (t + 8, 7, a, None, 4096, None),                              # host value absent
               (t + 9, 8, b, 96 << 10, 4096, None)]
    line = SiteLine("m:f", "cuda:0", rank=2, pid=5, node="n")
    for ts_ns, call, counters, available, swap_free, shape in records:
        parsed = parse_line(line.format(ts_ns, call, counters, available, swap_free, shape))
        allocator = None if counters is None else tuple(counters)
        assert_same(parsed, expected_record(ts_ns, call, "m:f", "cuda:0", allocator, available, swap_free, shape,
                                            rank=2, pid=5, node="n"))


def test_the_writers_push_writes_the_lines_site_line_format_writes(tmp_path):
    # push writes SiteLine.format out in place (the hot path): the same text for every case of its kept parts,
    # the ts exact to the nanosecond (a second crossed, the clock stepped back, a value of 0 and of 999999999 ns).
    a, b = AllocatorCounters(1 << 30, 5, 7, 1, 0, 0), AllocatorCounters(1 << 31, 6, 8, 1, 0, 0)
    t = 1795000000_000000000
    records = [(t + 999_999_999, 0, a, 100 << 10, 0), (t + 1_000_000_000, 1, a, 100 << 10, 0),
               (t + 1_000_000_007, 2, b, 100 << 10, 0), (t + 5, 3, b, 96 << 10, 4096),   # stepped back
               (t + 6, 4, AllocatorCounters(*a), 96 << 10, 4096), (t + 7, 5, None, None, 4096),
               (3 * 1_000_000_000 + 17, 6, a, 1, 2), (t + 2_000_000_000, 7, a, 1, 2)]
    writer, _ = open_writer(tmp_path)
    assert writer.open(rank=2)
    reference = SiteLine("m:f", "cuda:0", rank=2, pid=os.getpid(), node="node-1")
    for ts_ns, call, counters, available, swap_free in records:
        writer.push(ts_ns, call, "m:f", "cuda:0", counters, available, swap_free)
    writer.close()
    assert writer.path is not None
    written = Path(writer.path).read_text().splitlines(keepends=True)
    assert written == [reference.format(*record) for record in records]
    assert [line[6:line.index(",")] for line in written] == [
        f"{ts // 10**9}.{ts % 10**9:09d}" for ts, *_ in records]


def open_writer(directory: Path, rank: int = 0, **limits) -> tuple[CallLogWriter, HookState]:
    state = HookState(node="node-1", targets={}, log_configured=True)
    writer = CallLogWriter(str(directory), state, **{"max_queue": 65536, "flush_records": 4096,
                                                     "flush_interval_s": 0.5, **limits})
    return writer, state


def test_threads_recording_one_site_never_mix_their_values(tmp_path):
    writer, _ = open_writer(tmp_path, max_queue=10**6)
    assert writer.open(rank=0)
    threads_n, per_thread = 4, 3000
    shared = [AllocatorCounters(v, v, v, v, v, v) for v in range(3)]

    def run(k):
        for i in range(per_thread):
            v = (k + i) % 3   # values shared by the threads, repeating, so the cached parts are reused
            writer.push(time.time_ns(), v, "m:f", "cuda:0", shared[v], v << 10, v << 10)

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
    writer.close()
    assert writer.path is not None
    lines = [json.loads(line) for line in Path(writer.path).read_text().splitlines()]
    assert len(lines) == threads_n * per_thread
    for line in lines:   # every field of a line shows the values of the record it was written for
        v = line["call"]
        assert [line[f] for f in FIELDS] == [v] * 6
        assert line["mem_available_bytes"] == line["swap_free_bytes"] == v << 10


def test_log_file_name_has_rank_and_pid(tmp_path):
    writer, _ = open_writer(tmp_path)
    assert writer.open(rank=5)
    writer.push(time.time_ns(), 0, "a:b", "cpu", None, 1, 2, None)
    writer.close()
    assert [p.name for p in tmp_path.iterdir()] == [f"memtel-calls-rank5-pid{os.getpid()}.jsonl"]
    assert log_file_name(5, os.getpid()) == f"memtel-calls-rank5-pid{os.getpid()}.jsonl"


def test_a_record_pushed_before_open_is_written_after_it(tmp_path):
    writer, _ = open_writer(tmp_path)
    writer.push(time.time_ns(), 0, "a:b", "cpu", None, 1, 2, None)  # another thread's first call, mid-open
    assert writer.open(rank=0)
    writer.push(time.time_ns(), 1, "a:b", "cpu", None, 1, 2, None)
    writer.close()
    assert writer.path is not None
    records = [json.loads(line) for line in Path(writer.path).read_text().splitlines()]
    assert [r["call"] for r in records] == [0, 1] and records[0]["pid"] == os.getpid()


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
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60, env=child_env())
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
                         env=child_env())
    assert out.returncode == 0, out.stderr
    died_by_sigterm, child_pid = out.stdout.split()
    assert died_by_sigterm == "True"
    logs = {p.name: [json.loads(line) for line in p.read_text().splitlines()] for p in tmp_path.glob("*.jsonl")}
    child = logs.pop(f"memtel-calls-rank0-pid{child_pid}.jsonl")
    assert [r["call"] for r in child] == list(range(25))          # its own index, from 0
    (parent,) = logs.values()
    assert [r["call"] for r in parent] == list(range(10))


# -- issue 16, case 1: the hook's log was opened without the state file's guards ---------------------------

def test_hook_log_directory_is_created_private_and_its_file_0600(make_module, tmp_path):
    name = make_module("def f(x):\n    return x\n")
    module = importlib.import_module(name)
    log_dir = tmp_path / "new" / "logs"
    handle = telemetry.install([f"{name}:f"], port=None, log_dir=log_dir)
    module.f(1)
    handle.flush()
    assert stat.S_IMODE(log_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(Path(handle.log_path).stat().st_mode) == 0o600
    assert len(Path(handle.log_path).read_text().splitlines()) == 1


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_hook_log_in_a_directory_others_can_write_is_refused_with_one_line(make_module, tmp_path, caplog, mode):
    name = make_module("def f(x):\n    return x\n")
    module = importlib.import_module(name)
    log_dir = tmp_path / "shared"
    log_dir.mkdir()
    log_dir.chmod(mode)
    registry = CollectorRegistry()
    caplog.set_level("INFO", logger="memtel")
    handle = telemetry.install([f"{name}:f"], port=None, log_dir=log_dir, registry=registry)
    assert module.f(1) == 1 and module.f(2) == 2
    handle.flush()
    assert list(log_dir.iterdir()) == [] and handle.log_path is None
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "call log off" in errors[0] and "writable by group or others" in errors[0]
    labels = {"rank": "0", "node": NODE}
    assert registry.get_sample_value("memtel_hook_errors_total", {"site": "", "stage": "log_open", **labels}) == 1
    assert registry.get_sample_value("memtel_hook_calls_total", {"site": f"{name}:f", **labels}) == 2


def test_hook_log_in_a_directory_owned_by_another_user_is_refused(make_module, tmp_path, caplog):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    name = make_module("def f(x):\n    return x\n")
    module = importlib.import_module(name)
    log_dir = tmp_path / "theirs"
    log_dir.mkdir(mode=0o755)
    os.chown(log_dir, 65534, 65534)   # nobody: it could swap files in there under root's writes
    handle = telemetry.install([f"{name}:f"], port=None, log_dir=log_dir)
    module.f(1)
    handle.flush()
    assert list(log_dir.iterdir()) == [] and handle.log_path is None
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "owned by uid 65534" in errors[0]


def test_hook_log_never_follows_a_symlink_planted_at_its_file_name(make_module, tmp_path, caplog):
    name = make_module("def f(x):\n    return x\n")
    module = importlib.import_module(name)
    victim = tmp_path / "root-only"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    log_dir = tmp_path / "logs"
    log_dir.mkdir(mode=0o700)
    (log_dir / log_file_name(0, os.getpid())).symlink_to(victim)
    registry = CollectorRegistry()
    handle = telemetry.install([f"{name}:f"], port=None, log_dir=log_dir, registry=registry)
    for i in range(50):
        module.f(i)
    handle.flush()
    assert victim.read_text() == "precious\n"
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "symbolic link" in errors[0]
    assert registry.get_sample_value("memtel_hook_errors_total",
                                     {"site": "", "stage": "log_open", "rank": "0", "node": NODE}) == 1


# -- issue 16, case 10: the hook's log on a full disk --------------------------------------------------------

@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 64 KiB tmpfs (as root); skipped with the reason where mounting is not permitted."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mount_point)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


FULL_DISK_CHILD = """
import json, logging, os, sys, time
sys.path.insert(0, sys.argv[1])
import telemetry, disk_mod
from telemetry.hook import log_writer
truncate, cut_backs = os.ftruncate, []
def spy(fd, size):                      # records each torn line being cut back (the real call still runs)
    cut_backs.append((os.fstat(fd).st_size, size))
    return truncate(fd, size)
os.ftruncate = spy
log_writer.WARNING_INTERVAL_S = float(sys.argv[3])
logging.basicConfig(level=logging.WARNING, format="LOG %(levelname)s %(message)s")
log_dir = sys.argv[2]
handle = telemetry.install(["disk_mod:f"], port=None, log_dir=log_dir, flush_interval_s=3600,
                           flush_records=10**9)
disk_mod.f(0)                           # opens the log
handle.flush()
filler = os.path.join(os.path.dirname(log_dir), "filler")
fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
try:                                    # fill the disk, then leave a few KiB: the next flush fills it mid-chunk
    while True:
        os.write(fd, b"x" * 4096)
except OSError:
    pass
os.close(fd)
os.truncate(filler, os.path.getsize(filler) - 6000)
calls = 1
for round in range(5):                  # five flushes on a full disk
    for i in range(500):
        disk_mod.f(calls); calls += 1
    handle.flush()                      # the public flush: must not raise
full_calls = calls
os.unlink(filler)                       # room again: writing resumes
for i in range(100):
    disk_mod.f(calls); calls += 1
handle.flush()
state = handle.state
print(json.dumps({"calls": calls, "full_calls": full_calls, "dropped": state.log_dropped,
                  "errors": {f"{s}|{k}": v for (s, k), v in state.errors.items()}, "path": handle.log_path,
                  "cut_backs": cut_backs}))
"""


def test_hook_log_on_a_full_disk_drops_with_an_exact_count_no_torn_lines_and_raises_nothing(small_tmpfs):
    (small_tmpfs / "disk_mod.py").write_text("def f(x):\n    return x\n")
    log_dir = small_tmpfs / "logs"
    out = subprocess.run([sys.executable, "-c", FULL_DISK_CHILD, str(small_tmpfs), str(log_dir), "60"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env=child_env())
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert "Traceback" not in out.stderr, out.stderr
    data = Path(result["path"]).read_bytes()
    assert data.endswith(b"\n")
    # The disk filled mid-line: the partial line was written and cut back off (not left torn).
    assert result["cut_backs"] and all(torn > whole for torn, whole in result["cut_backs"])
    records = [json.loads(line) for line in data.decode().splitlines()]   # every line whole
    logged = [r["call"] for r in records]
    assert logged == sorted(set(logged))                                   # none twice, in order
    # The count is exact: every call either reached the file or was counted as dropped.
    assert result["dropped"]["write_failed"] == result["calls"] - len(records)
    assert result["dropped"]["queue_full"] == 0
    assert 0 < result["dropped"]["write_failed"] < result["full_calls"]      # some fitted, most did not
    assert logged[-100:] == list(range(result["full_calls"], result["calls"]))  # writing resumed
    assert result["errors"]["|log_write"] == 5
    warnings = [line for line in out.stderr.splitlines() if line.startswith("LOG WARNING")]
    assert len(warnings) == 1, out.stderr   # five failed flushes within a minute: one line
    assert "No space left on device" in warnings[0] and "records dropped" in warnings[0]


def test_hook_log_write_failure_lines_repeat_at_most_once_per_interval(small_tmpfs):
    # The same scenario with the interval shortened to 0 s: every failed flush may say so; with 60 s, one.
    (small_tmpfs / "disk_mod.py").write_text("def f(x):\n    return x\n")
    out = subprocess.run([sys.executable, "-c", FULL_DISK_CHILD, str(small_tmpfs), str(small_tmpfs / "logs"), "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, env=child_env())
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if line.startswith("LOG WARNING")]
    assert len(warnings) == 5, out.stderr


def test_the_reader_beside_the_writer_reads_every_line_as_written(make_module, tmp_path):
    from telemetry.hook.call_log import KEYS as READER_KEYS
    from telemetry.hook.call_log import read_call_logs

    assert list(READER_KEYS) == [*KEYS, "shape"]
    name = make_module("def f(x):\n    return x\n")
    module = importlib.import_module(name)
    counters = [AllocatorCounters(1 << 20, 1 << 19, 1, 0, 0, 0), AllocatorCounters(3 << 20, 2 << 20, 2, 0, 0, 0)]
    source = iter([counters[0], counters[0], counters[1], None])
    from telemetry.hook import set_allocator_source

    set_allocator_source(lambda: next(source), device="sim:0")
    handle = telemetry.install([f"{name}:f"], port=None, log_dir=tmp_path, record_shape=True)
    module.f(1)
    module.f(2)
    module.f(3)
    handle.flush()
    (records,) = read_call_logs(tmp_path).values()
    assert [(r.call, r.site, r.pid, r.device, r.allocator) for r in records] == [
        (0, f"{name}:f", os.getpid(), "sim:0", counters[0]), (1, f"{name}:f", os.getpid(), "sim:0", counters[1]),
        (2, f"{name}:f", os.getpid(), "cpu", None)]
    assert all(r.mem_available_bytes and r.shape is None for r in records)
