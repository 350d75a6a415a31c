import json
import logging
import os
import time
from pathlib import Path

from telemetry.daemon.collectors.kmsg import KmsgCollector
from telemetry.daemon.kmsg.classify import Classifier
from telemetry.daemon.kmsg.counts import KmsgCounts
from telemetry.daemon.kmsg.follower import KmsgFollower
from telemetry.daemon.kmsg.state import STATE_FILE_NAME, load_state, save_state

KMSG = Path(__file__).parents[1] / "fixtures" / "kmsg"


def test_bursts_within_the_window_are_one_event():
    counts = KmsgCounts(window_seconds=1.0)
    for usec in (0, 100_000, 900_000, 1_000_000):  # within 1 s of the first line
        counts.add_record(["nv_err_no_memory"], usec, 0.0, None)
    counts.add_record(["nv_err_no_memory"], 1_000_001, 0.0, None)  # a new event
    counts.add_record(["nv_err_no_memory"], 5_000_000, 0.0, None)  # another
    snap = counts.snapshot()
    assert snap.lines["nv_err_no_memory"] == 6 and snap.events["nv_err_no_memory"] == 3
    assert snap.records == 6


def test_events_are_per_kind():
    counts = KmsgCounts(window_seconds=1.0)
    counts.add_record(["xid:45", "nvrm_error"], 0, 0.0, 1)
    counts.add_record(["xid:79", "nvrm_error"], 10, 0.0, 2)
    snap = counts.snapshot()
    assert snap.events == {"xid:45": 1, "xid:79": 1, "nvrm_error": 1}
    assert snap.last_seq == 2


def test_xid_codes_are_bounded():
    counts = KmsgCounts(max_xid_codes=2)
    for code in (13, 31, 45, 48, 13):
        counts.add_record([f"xid:{code}"], code, 0.0, None)
    assert counts.snapshot().lines == {"xid:13": 2, "xid:31": 1, "xid:other": 2}


def test_state_round_trip_and_boot_change(tmp_path):
    path = tmp_path / STATE_FILE_NAME
    counts = KmsgCounts()
    counts.add_record(["xid:45", "nvrm_error"], 123, 1700000000.5, 41)
    counts.add_missed(3)
    save_state(path, counts.snapshot(), "boot-a", "/dev/kmsg")
    assert not [p for p in tmp_path.iterdir() if p.name != STATE_FILE_NAME]  # no temporary file left behind
    same = load_state(path, "boot-a", "/dev/kmsg")
    assert same.snapshot == counts.snapshot() and "resuming" in same.message and not same.problem
    assert load_state(path, "boot-b", "/dev/kmsg").snapshot is None  # a reboot starts from zero
    assert "another boot" in load_state(path, "boot-b", "/dev/kmsg").message
    assert load_state(path, "boot-a", "/tmp/other").snapshot is None


def test_corrupt_state_is_moved_aside_with_a_clear_message(tmp_path):
    path = tmp_path / STATE_FILE_NAME
    for content in ("{not json", json.dumps({"version": 1, "boot_id": "b", "source": "s", "lines": {"x": "many"}}),
                    json.dumps([1, 2]), json.dumps({"version": 99})):
        path.write_text(content)
        result = load_state(path, "b", "s")
        assert result.snapshot is None and result.problem
        assert "is corrupt" in result.message and "moved it to" in result.message
        assert not path.exists() and list(tmp_path.glob(STATE_FILE_NAME + ".corrupt-*"))
    missing = load_state(path, "b", "s")
    assert missing.snapshot is None and not missing.problem and "no kmsg state file" in missing.message


def _follow(path: Path, state_path: Path, **kwargs) -> KmsgFollower:
    follower = KmsgFollower(str(path), Classifier(), KmsgCounts(window_seconds=2.0), state_path=state_path,
                            boot_id="boot-test", **kwargs)
    follower.load_state()
    follower.start()
    return follower


def _wait_records(follower: KmsgFollower, n: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while follower.counts.snapshot().records < n:
        assert time.monotonic() < deadline, follower.counts.snapshot()
        time.sleep(0.02)


def test_follower_on_a_file_counts_the_unified_memory_fixture_and_follows_appends(tmp_path):
    log_file = tmp_path / "kern.kmsg"
    text = (KMSG / "dgx-spark__gb10__580.142.kmsg").read_text()
    log_file.write_text(text)
    follower = _follow(log_file, tmp_path / STATE_FILE_NAME)
    try:
        _wait_records(follower, 31)
        snap = follower.counts.snapshot()
        assert snap.lines["nv_err_no_memory"] == 16 and snap.events["nv_err_no_memory"] == 1
        assert snap.lines["xid:45"] == 3 and snap.events["xid:45"] == 1
        assert snap.lines["oom_kill"] == 1
        assert snap.missed == 6  # the fixture's sequence numbers jump from 1203 to 1210
        with open(log_file, "a") as f:  # followed like tail -f
            f.write("4,1240,999000000,-;NVRM: Xid (PCI:000f:01:00): 31, pid=1, name=python3, Ch 00000008\n")
        _wait_records(follower, 32)
        snap = follower.counts.snapshot()
        assert snap.lines["xid:31"] == 1 and snap.missed == 8
    finally:
        follower.stop()
    saved = json.loads((tmp_path / STATE_FILE_NAME).read_text())
    assert saved["last_seq"] == 1240 and saved["lines"]["xid:31"] == 1


def test_follower_restart_skips_seen_records_and_counts_gaps_as_missed(tmp_path):
    log_file = tmp_path / "kern.kmsg"
    log_file.write_text("4,10,1000,-;NVRM: Xid (PCI:0000:01:00): 13, x\n"
                        "4,11,2000,-;NVRM: Xid (PCI:0000:01:00): 13, x\n")
    state = tmp_path / STATE_FILE_NAME
    first = _follow(log_file, state)
    _wait_records(first, 2)
    first.stop()
    # While "down": two more records, one lost (seq 12 scrolled out of the buffer).
    with open(log_file, "a") as f:
        f.write("4,13,3000,-;NVRM: Xid (PCI:0000:01:00): 13, x\n")
    second = _follow(log_file, state)
    try:
        _wait_records(second, 3)
        time.sleep(0.3)
        snap = second.counts.snapshot()
        assert snap.lines["xid:13"] == 3  # 2 before the restart + 1 after, none twice
        assert snap.records == 3 and snap.missed == 1
    finally:
        second.stop()


def test_unreadable_log_makes_the_collector_fail_and_retries(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    missing = tmp_path / "fifo"
    follower = _follow(missing, tmp_path / STATE_FILE_NAME, retry_interval=0.1)
    try:
        deadline = time.monotonic() + 5
        while follower.error is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        collector = KmsgCollector(follower)
        try:
            collector.collect()
            raise AssertionError("collect() should fail while the log is unreadable")
        except RuntimeError as exc:
            assert str(missing) in str(exc)
        os.mkfifo(missing)  # the log appears: a FIFO, as some setups feed it
        deadline = time.monotonic() + 5
        while follower.error is not None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        fd = os.open(missing, os.O_WRONLY)
        os.write(fd, b"NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051)\n")
        os.close(fd)
        _wait_records(follower, 1)
        names = {m.name for m in collector.collect()}
        assert "memtel_kernel_nv_err_no_memory" in names
    finally:
        follower.stop()
    assert sum("cannot read the kernel log" in r.message for r in caplog.records) == 1  # logged once


def test_state_write_failure_is_counted_and_logged_once_and_counting_goes_on(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    log_file = tmp_path / "kern.kmsg"
    log_file.write_text("4,1,1000,-;NVRM: Xid (PCI:0000:01:00): 13, x\n")
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    state_dir.rmdir()
    state_dir.write_text("a file where the state directory should be")
    follower = _follow(log_file, state_dir / STATE_FILE_NAME, persist_interval=0.05)
    try:
        _wait_records(follower, 1)
        with open(log_file, "a") as f:
            f.write("4,2,2000,-;NVRM: Xid (PCI:0000:01:00): 13, x\n")
        _wait_records(follower, 2)
        deadline = time.monotonic() + 5
        while follower.counts.snapshot().state_write_failures < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert follower.counts.snapshot().lines["xid:13"] == 2
    finally:
        follower.stop()
    assert sum("cannot write the kmsg state file" in r.getMessage() for r in caplog.records) == 1


def test_plain_text_file_resumes_at_its_offset_and_follows_truncation(tmp_path):
    # Lines without the kmsg header (e.g. a journalctl -k export) carry no sequence number: a restart must
    # resume at the saved byte offset rather than count the file again.
    log_file = tmp_path / "kern.log"
    line = ("Nov 29 10:00:00 node kernel: NVRM: Xid (PCI:0000:01:00): 79, pid=1, name=python3, "
            "GPU has fallen off the bus.\n")
    log_file.write_text(line * 2)
    state = tmp_path / STATE_FILE_NAME
    first = _follow(log_file, state)
    _wait_records(first, 2)
    first.stop()
    with open(log_file, "a") as f:
        f.write(line)
    second = _follow(log_file, state)
    try:
        _wait_records(second, 3)
        time.sleep(0.3)
        assert second.counts.snapshot().lines["xid:79"] == 3  # 2 + 1, none twice
        log_file.write_text(line)  # truncated and rewritten (copytruncate rotation)
        _wait_records(second, 4)
        assert second.counts.snapshot().lines["xid:79"] == 4
    finally:
        second.stop()
