"""Issue 16, cases 1, 2, 9 and 11 on the real daemon: its state directory and state file under attack.

The kernel log here is a plain file of /dev/kmsg records (`--kmsg FILE`), so these tests need no
write into the machine's kernel log; the full disk is a real tmpfs (root only, else skipped).
"""

from __future__ import annotations

import functools
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.daemon.helpers import Daemon, read_kmsg, run_cli, wait_for
from tests.support.cli import call_main
from tests.support.tmpfs import SmallTmpfs, fill

NOBODY = 65534
STATE = "kmsg-state.json"
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the daemon's case: root in a hostile directory)")


def xid_records(first_seq: int, count: int, codes: int = 1) -> str:
    return "".join(f"3,{first_seq + i},{1_000_000 + i},-;NVRM: Xid (PCI:0000:01:00): {100 + i % codes}, pid=1\n"
                   for i in range(count))


@functools.cache
def _only_kmsg_state() -> tuple[str, ...]:
    """The flight recorder (issue 11) writes in the state directory too; these tests are about the kmsg state."""
    return ("--no-flight-recorder",) if "--no-flight-recorder" in call_main(["daemon", "--help"]).stdout else ()


def kmsg_daemon(tmp_path: Path, state_dir: Path, log: Path, *args: str) -> Daemon:
    return Daemon(state_dir, "--kmsg", str(log), "--disable-collector", "nvml", "--disable-collector", "processes",
                  *_only_kmsg_state(), *args, log_path=tmp_path / f"daemon-{time.monotonic_ns()}.log")


def records(daemon: Daemon) -> float:
    return daemon.scrape().value("memtel_kernel_kmsg_records_total") or 0.0


@root_only
def test_state_dir_created_first_by_another_user_with_a_planted_symlink_is_refused(tmp_path):
    # The reported attack: another user creates the state directory first and plants the temporary file's
    # name as a symlink to a root-only file; the daemon, as root, wrote through it.
    victim = tmp_path / "root-only"
    victim.write_text("root's secret\n")
    victim.chmod(0o600)
    planted = tmp_path / "shared" / "memtel"
    planted.parent.mkdir(mode=0o1777)
    planted.mkdir()
    for pid in range(1, 50):
        (planted / f".{STATE}.{pid}.tmp").symlink_to(victim)
    os.lchown(planted, NOBODY, NOBODY)
    result = run_cli("--listen", "127.0.0.1:0", "--state-dir", str(planted), "--kmsg", str(victim))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr
    assert f"state directory {planted} is owned by uid {NOBODY}" in lines[0]
    assert victim.read_text() == "root's secret\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600


def test_state_dir_writable_by_others_is_refused(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    result = run_cli("--listen", "127.0.0.1:0", "--state-dir", str(loose), "--kmsg", "/dev/null")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "writable by group or others (mode 0777)" in result.stderr


def test_a_symlink_in_place_of_the_state_file_is_moved_aside_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("do not touch\n")
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / STATE).symlink_to(victim)
    log = tmp_path / "kern.kmsg"
    log.write_text(xid_records(1, 3))
    with kmsg_daemon(tmp_path, state, log) as daemon:
        wait_for(lambda: records(daemon) == 3, what="3 records")
    assert victim.read_text() == "do not touch\n"
    assert not (state / STATE).is_symlink() and json.loads((state / STATE).read_text())["records"] == 3
    assert [p.is_symlink() for p in state.glob(f"{STATE}.corrupt-*")] == [True]
    assert "is corrupt (unreadable" in daemon.log()


def test_stale_temporaries_of_a_killed_save_are_removed_at_start(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    for name in (f".{STATE}.1234.tmp", f".{STATE}.a1b2c3d4e5f6.tmp"):
        (state / name).write_text('{"torn')
    log = tmp_path / "kern.kmsg"
    log.write_text(xid_records(1, 1))
    with kmsg_daemon(tmp_path, state, log) as daemon:
        wait_for(lambda: records(daemon) == 1, what="1 record")
    assert sorted(p.name for p in state.glob(f"*{STATE}*")) == [STATE]
    assert "removed 2 temporary state file(s)" in daemon.log()


def test_nearly_full_disk_short_write_keeps_the_good_state_and_failures_survive_a_restart(tmp_path):
    # The reported case: a short write (4,096 of 9,252 bytes) replaced the good state with a torn one, the
    # failure counter stayed 0, and after a restart the counters fell back to what was still in the ring.
    log = tmp_path / "kern.kmsg"
    config = tmp_path / "daemon.yaml"
    config.write_text("kmsg:\n  max_xid_codes: 300\n")
    log.write_text(xid_records(1, 200, codes=200))  # 200 Xid codes: a state of ~30 kB
    with SmallTmpfs(tmp_path / "small", 256 * 1024) as small:
        state = small / "state"
        with kmsg_daemon(tmp_path, state, log, "--config", str(config)) as first:
            wait_for(lambda: records(first) == 200, what="200 records")
            wait_for(lambda: (state / STATE).exists() and json.loads((state / STATE).read_text())["records"] == 200,
                     what="the state saved")
            good = (state / STATE).read_bytes()
            assert len(good) > 9252
            filler = fill(small, leave_bytes=4096)  # one page left: the next save is a short write
            with open(log, "a") as f:
                f.write(xid_records(201, 50, codes=200))
            scrape = wait_for(lambda: (s := first.scrape()).value(
                "memtel_kernel_kmsg_state_write_failures_total") >= 2 and s, what="failures counted")
            assert scrape.value("memtel_kernel_kmsg_records_total") == 250  # counting goes on
            assert (state / STATE).read_bytes() == good  # the last good state, not a torn one
            assert sorted(p.name for p in state.glob(f"*{STATE}*")) == [STATE]  # no temporaries left behind
            filler.unlink()  # space again: the next save carries the failure count
            saved = wait_for(lambda: json.loads((state / STATE).read_text()) if json.loads(
                (state / STATE).read_text())["records"] == 250 else None, what="a save after the disk freed up")
            failures = first.scrape().value("memtel_kernel_kmsg_state_write_failures_total")
            assert saved["state_write_failures"] >= 2
        assert first.proc.returncode == 0
        with kmsg_daemon(tmp_path, state, log, "--config", str(config)) as second:
            time.sleep(0.5)
            scrape = second.scrape()
            assert scrape.value("memtel_kernel_kmsg_records_total") == 250  # nothing counted twice or lost
            assert scrape.value("memtel_kernel_xid_total", xid="100") == 2
            assert scrape.value("memtel_kernel_kmsg_state_write_failures_total") >= failures  # never goes down
    assert first.log().count("cannot write the kmsg state file") == 1  # logged once, not once a second


def _corrupt_states(state_dir: Path) -> dict[str, object]:
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    valid = {"version": 1, "boot_id": boot, "source": "SOURCE", "records": 1, "missed": 0,
             "state_write_failures": 0, "lines": {}, "events": {}}
    return {
        "garbage": os.urandom(4096),
        "not_utf8": b"\xff\xfe{" * 100,
        "deeply_nested": b"[" * 200_000 + b"]" * 200_000,
        "giant_integer": json.dumps(valid).replace('"records": 1', '"records": ' + "9" * 5000).encode(),
        "huge_counter": json.dumps({**valid, "records": 2**70}).encode(),
        "nan": json.dumps({**valid, "last_seen_wall": {"xid:13": 1}}).replace("1}", "NaN}").encode(),
        "wrong_types": json.dumps({**valid, "lines": {"x": "many"}}).encode(),
        "two_gigabytes": None,  # sparse, made below
        "a_fifo": "fifo",
        "a_directory": "dir",
    }


@dataclass
class CorruptRun:
    """What one daemon did with one kind of corrupt state file (`corrupt_runs`)."""

    path: Path  # the state file
    rss: float = 0.0
    log: str = ""
    moved_aside: int = 0
    records_saved: object = None
    error: BaseException | None = None


@pytest.fixture(scope="module")
def corrupt_runs(tmp_path_factory) -> dict[str, CorruptRun]:
    """One daemon per kind of corrupt state file, all started at once (each on its own state directory,
    kernel log and port), waited for, scraped and stopped; the tests below assert one kind each."""
    runs: dict[str, CorruptRun] = {}
    daemons: dict[str, Daemon] = {}
    for kind, content in _corrupt_states(Path("/tmp")).items():
        tmp_path = tmp_path_factory.mktemp(kind)
        state = tmp_path / "state"
        state.mkdir(mode=0o700)
        log = tmp_path / "kern.kmsg"
        log.write_text(xid_records(1, 2))
        path = state / STATE
        if kind == "two_gigabytes":
            with open(path, "wb") as f:
                f.truncate(2 << 30)
        elif content == "fifo":
            os.mkfifo(path)
        elif content == "dir":
            path.mkdir()
        else:
            assert isinstance(content, bytes)
            path.write_bytes(content.replace(b"SOURCE", str(log).encode()))
        runs[kind] = CorruptRun(path)
        daemons[kind] = kmsg_daemon(tmp_path, state, log)
    try:
        for daemon in daemons.values():
            daemon.start(wait=False)
        for kind, daemon in daemons.items():
            try:
                daemon.wait_ready()
                wait_for(lambda d=daemon: records(d) == 2, timeout=15, what="the log counted from its start")
                runs[kind].rss = daemon.scrape().value("process_resident_memory_bytes")
            except (AssertionError, OSError) as exc:  # failed: said by this kind's test, the others go on
                runs[kind].error = exc
    finally:
        for kind, daemon in daemons.items():
            try:
                daemon.stop()
            except AssertionError as exc:  # did not stop on SIGTERM (killed): this kind's test says so
                runs[kind].error = runs[kind].error or exc
    for kind, run in runs.items():
        run.log = daemons[kind].log()
        run.moved_aside = len(list(run.path.parent.glob(f"{STATE}.corrupt-*")))
        try:
            run.records_saved = json.loads(run.path.read_text())["records"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            run.records_saved = f"unreadable: {exc!r}"
    return runs


@pytest.mark.parametrize("kind", list(_corrupt_states(Path("/tmp"))))
def test_a_corrupt_state_file_of_any_kind_is_moved_aside_and_the_daemon_starts(corrupt_runs, kind):
    # Before: deeply nested, giant-integer or 2 GB state files crashed the daemon (an OOM loop under MemoryMax).
    run = corrupt_runs[kind]
    if run.error is not None:
        raise AssertionError(f"{kind}: {run.error}\n{run.log}")
    assert run.rss < 200 * 2**20  # the file was not read into memory
    assert run.log.count(f"kmsg state file {run.path} is corrupt") == 1
    assert run.moved_aside == 1
    assert run.records_saved == 2  # a good state written again
    assert "Traceback" not in run.log


needs_kmsg = pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK), reason="needs to read /dev/kmsg (root)")


@needs_kmsg
@pytest.mark.parametrize("how", ["last_seq_ahead_same_boot_id", "last_seq_ahead_unreadable_boot_id",
                                 "same_seq_other_time"])
def test_a_sequence_number_that_went_backwards_is_a_new_boot_not_silence(tmp_path, how):
    # Before: a saved last_seq ahead of the kernel's (same or unreadable boot id) silently dropped every record.
    ring = [(seq, usec) for seq, usec, _message in read_kmsg()]
    oldest_seq, oldest_usec = ring[0]
    newest_seq = ring[-1][0]
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    proc = tmp_path / "proc"
    args: tuple[str, ...] = ()
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    if how == "last_seq_ahead_unreadable_boot_id":
        proc.mkdir()
        (proc / "meminfo").write_text(Path("/proc/meminfo").read_text())
        args = ("--proc-root", str(proc), "--disable-collector", "vmstat", "--disable-collector", "pressure")
        boot = "unknown"
    last_seq, last_usec = newest_seq + 1_000_000, 5
    if how == "same_seq_other_time":
        last_seq, last_usec = oldest_seq, oldest_usec + 1
    saved = {"version": 1, "boot_id": boot, "source": "/dev/kmsg", "last_seq": last_seq, "last_usec": last_usec,
             "records": 123456, "missed": 0, "state_write_failures": 3, "lines": {"nv_err_no_memory": 99},
             "events": {"nv_err_no_memory": 9}}
    (state / STATE).write_text(json.dumps(saved))
    daemon = Daemon(state, "--disable-collector", "nvml", "--disable-collector", "processes", *args)
    with daemon:
        scrape = wait_for(lambda: ((s := daemon.scrape()).value("memtel_kernel_kmsg_records_total") or 0)
                          >= 0.9 * len(ring) and s, what="the ring counted")
    assert "sequence numbers went backwards" in daemon.log()
    counted = scrape.value("memtel_kernel_kmsg_records_total")
    assert counted >= 0.9 * len(ring)  # the ring was counted, not skipped as "seen before"
    assert counted < 123456  # from zero, not on top of another boot's counts
    assert scrape.value("memtel_kernel_kmsg_state_write_failures_total") == 3  # kept

