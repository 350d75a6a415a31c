"""The real daemon against the real kernel log: root writes lines into /dev/kmsg, /metrics must agree.

Other tests on this machine may write NVRM lines into the kernel log at the same time. Every check
runs between two sync markers that only this daemon instance counts, and a round is repeated when an
independent reader of /dev/kmsg finds a foreign driver line between those markers; the unique token in
our own lines (user pattern `mine`) gives a second, foreign-proof count.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
import uuid
from pathlib import Path

import pytest

from tests.daemon.helpers import Daemon, KmsgTap, Scrape, between, wait_for
from tests.support.kmsg import DAEMON_COUNTS_TEST_LINES, write_kmsg

pytestmark = pytest.mark.kmsg

NO_MEMORY = ("NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) returned "
             "from _memdescAllocInternal(pMemDesc) @ mem_desc.c:1359 {tok}")
NO_MEMORY_ASSERT = ("NVRM: nvAssertOkFailedNoLog: Assertion failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) "
                    "returned from pmaAllocatePages(pPma) @ mem_mgr.c:2840 {tok}")
XID = "NVRM: Xid (PCI:0000:dc:00): {code}, pid=1818990, name=python3, Ch 00000001 {tok}"
OOM = ("Out of memory: Killed process 4242 (python3) total-vm:1452340kB, anon-rss:1182345kB, file-rss:1024kB, "
       "shmem-rss:0kB, UID:1000 pgtables:2402kB oom_score_adj:0 {tok}")
UNRELATED = (
    "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  580.95.05  Release Build {tok}",
    "NVRM: GPU at PCI:0000:dc:00: GPU-5b2e7c3a-0d4f-4e3b-8a2c-1f9e6d7c8b90 {tok}",
    "usb 1-1: new high-speed USB device number 3 using xhci_hcd {tok}",
    "myapp[123]: Out of memory while resizing a buffer {tok}",
    "oom_reaper: reaped process 4242 (python3), now anon-rss:0kB, file-rss:0kB, shmem-rss:0kB {tok}",
    "python3 invoked oom-killer: gfp_mask=0x140dca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0 {tok}",
)
_DRIVER_LINE = re.compile(r"NVRM|NV_ERR|Killed process|Xid")
ROUNDS = 3  # retries when a foreign driver line lands between our markers


class KmsgDaemon(Daemon):
    def __init__(self, state_dir, token: str, *args: str) -> None:
        self.instance = uuid.uuid4().hex[:10]
        self.token = token
        self.syncs = 0
        super().__init__(state_dir, *DAEMON_COUNTS_TEST_LINES,
                         "--kmsg-pattern", f"sync_{self.instance}=memtel-sync-{self.instance} ",
                         "--kmsg-pattern", f"mine={token}", *args)

    def sync(self) -> tuple[Scrape, str]:
        """Write a marker only this instance counts and wait until it is counted: everything logged
        before it has been read. Returns the scrape and the marker text."""
        self.syncs += 1
        marker = f"memtel-sync-{self.instance} n={self.syncs};"
        write_kmsg([marker])
        scrape = wait_for(lambda: self._synced(), timeout=15, what=f"marker {marker} counted")
        return scrape, marker

    def _synced(self) -> Scrape | None:
        scrape = self.scrape()
        seen = scrape.value("memtel_kernel_pattern_matches_total", pattern=f"sync_{self.instance}")
        return scrape if seen == self.syncs else None


def value(scrape: Scrape, name: str, **labels: str) -> float:
    found = scrape.value(name, **labels)
    return 0.0 if found is None else found  # labelled series appear with their first line


def deltas(before: Scrape, after: Scrape, names: list[tuple]) -> dict:
    return {key: value(after, key[0], **dict(key[1:])) - value(before, key[0], **dict(key[1:])) for key in names}


def foreign_driver_lines(tap: KmsgTap, start: str, end: str, token: str) -> list[str]:
    """Driver-looking lines between our markers that are not ours (seen by an independent reader)."""
    if tap.overrun:
        return ["(the test's own reader fell behind: cannot tell)"]
    return [msg for _, _, msg in between(tap.records, start, end) if token not in msg and _DRIVER_LINE.search(msg)]


def run_round(daemon: KmsgDaemon, lines: list[str], between_writes=None, retry_sleep: float = 1.0, pace_every=100):
    """Write `lines` between two markers; retry the round if foreign driver lines interleave.
    Returns (scrape before, scrape after, tap) where tap holds every record from the first marker on."""
    for attempt in range(ROUNDS):
        if attempt:
            time.sleep(retry_sleep)  # past the burst window of the rejected round's lines
        with KmsgTap() as tap:
            before, start = daemon.sync()
            write_kmsg(lines, pace_every=pace_every)
            if between_writes:
                between_writes()
            after, end = daemon.sync()
        foreign = foreign_driver_lines(tap, start, end, daemon.token)
        if not foreign:
            return before, after, tap, (start, end)
        print(f"round {attempt}: foreign lines between our markers, repeating: {foreign[:3]}")
    pytest.fail(f"foreign driver lines interleaved with ours in {ROUNDS} rounds")


KEYS = [("memtel_kernel_nv_err_no_memory_total",), ("memtel_kernel_nv_err_no_memory_events_total",),
        ("memtel_kernel_nvrm_errors_total",), ("memtel_kernel_nvrm_error_events_total",),
        ("memtel_kernel_xid_total", ("xid", "45")), ("memtel_kernel_xid_total", ("xid", "79")),
        ("memtel_kernel_xid_events_total", ("xid", "45")), ("memtel_kernel_oom_kills_total",),
        ("memtel_kernel_oom_kill_events_total",), ("memtel_kernel_pattern_matches_total", ("pattern", "mine")),
        ("memtel_kernel_pattern_events_total", ("pattern", "mine")), ("memtel_kernel_kmsg_missed_records_total",)]


def test_each_counter_rises_by_exactly_the_lines_written_and_bursts_are_events(tmp_path):
    tok = f"memtel-t-{uuid.uuid4().hex[:12]}"
    lines = [NO_MEMORY.format(tok=tok), NO_MEMORY_ASSERT.format(tok=tok), NO_MEMORY.format(tok=tok),
             XID.format(code=45, tok=tok), XID.format(code=45, tok=tok), XID.format(code=79, tok=tok),
             OOM.format(tok=tok)] + [line.format(tok=tok) for line in UNRELATED]

    def second_burst():  # after the burst window: the same kind again is a new event
        time.sleep(0.8)
        write_kmsg([NO_MEMORY.format(tok=tok)] * 2)

    with KmsgDaemon(tmp_path / "state", tok, "--burst-window", "0.5") as daemon:
        time.sleep(0.6)  # past the window of any earlier line of these kinds
        before, after, _, _ = run_round(daemon, lines, second_burst)
        got = deltas(before, after, KEYS)
        assert got == {
            KEYS[0]: 5, KEYS[1]: 2,  # 3 + 2 NV_ERR_NO_MEMORY lines, two bursts
            KEYS[2]: 8, KEYS[3]: 2,  # NVRM errors: 5 no-memory + 3 Xid lines; unrelated NVRM lines not counted
            KEYS[4]: 2, KEYS[5]: 1, KEYS[6]: 1,
            KEYS[7]: 1, KEYS[8]: 1,
            KEYS[9]: len(lines) + 2, KEYS[10]: 2,
            KEYS[11]: 0,
        }
        seen = after.value("memtel_kernel_nv_err_no_memory_last_seen_timestamp_seconds")
        assert abs(seen - time.time()) < 10
        assert after.value("memtel_kernel_xid_last_seen_timestamp_seconds", xid="79") <= seen


def test_burst_of_1000_lines_counts_exactly_and_is_one_event(tmp_path):
    tok = f"memtel-b-{uuid.uuid4().hex[:12]}"
    lines = [NO_MEMORY.format(tok=f"{tok} #{i}") for i in range(1000)]
    with KmsgDaemon(tmp_path / "state", tok, "--burst-window", "2") as daemon:
        time.sleep(2.2)  # past the burst window of earlier NV_ERR_NO_MEMORY lines (other tests write them too)
        before, after, tap, (start, end) = run_round(daemon, lines, retry_sleep=2.2, pace_every=50)
        seq_start, seq_end = tap.seq_of(start), tap.seq_of(end)
        got = deltas(before, after, KEYS)
        assert got[KEYS[0]] == 1000 and got[KEYS[1]] == 1
        assert got[KEYS[9]] == 1000 and got[KEYS[10]] == 1
        assert got[KEYS[11]] == 0  # the reader kept up with the 128 KiB ring buffer
        # Every record between the markers was read exactly once (foreign ones included).
        records_delta = (value(after, "memtel_kernel_kmsg_records_total")
                         - value(before, "memtel_kernel_kmsg_records_total"))
        assert records_delta == seq_end - seq_start


def test_restart_counts_nothing_twice_and_counts_lines_logged_while_down(tmp_path):
    tok = f"memtel-r-{uuid.uuid4().hex[:12]}"
    state = tmp_path / "state"
    for _ in range(ROUNDS):
        with KmsgTap() as tap:
            with KmsgDaemon(state, tok) as first:
                _, start = first.sync()
                write_kmsg([NO_MEMORY.format(tok=tok)] * 5)
                counted, _ = first.sync()
            assert first.proc.returncode == 0
            saved = json.loads((state / "kmsg-state.json").read_text())
            write_kmsg([NO_MEMORY.format(tok=tok)] * 3)  # logged while the daemon is down
            with KmsgDaemon(state, tok) as second:
                resumed, end = second.sync()
        if not foreign_driver_lines(tap, start, end, tok):
            break
        state_files = list(state.iterdir())
        for path in state_files:  # the kmsg state, and the flight recorder's directory
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    else:
        pytest.fail("foreign driver lines interleaved with ours")
    assert saved["boot_id"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert saved["last_seq"] is not None
    assert "resuming kernel-log counts" in second.log()
    assert value(counted, "memtel_kernel_pattern_matches_total", pattern="mine") == 5
    assert value(resumed, "memtel_kernel_pattern_matches_total", pattern="mine") == 8  # 5 kept + 3, none twice
    assert (value(resumed, "memtel_kernel_nv_err_no_memory_total")
            == value(counted, "memtel_kernel_nv_err_no_memory_total") + 3)
    assert value(resumed, "memtel_kernel_kmsg_records_total") > value(counted, "memtel_kernel_kmsg_records_total")


def test_corrupt_or_deleted_state_recovers_with_a_clear_log_line(tmp_path):
    tok = f"memtel-c-{uuid.uuid4().hex[:12]}"
    state = tmp_path / "state"
    with KmsgDaemon(state, tok) as first:
        first.sync()
    state_file = state / "kmsg-state.json"
    state_file.write_text('{"version": 1, "boot_id": "trunc')  # a torn write from some other tool

    with KmsgDaemon(state, tok) as second:
        before, after, _, _ = run_round(second, [NO_MEMORY.format(tok=tok)] * 4)
        assert deltas(before, after, KEYS[:1])[KEYS[0]] == 4
    log = second.log()
    assert f"kmsg state file {state_file} is corrupt" in log and "moved it to" in log
    (aside,) = state.glob("kmsg-state.json.corrupt-*")
    assert aside.read_text().startswith('{"version": 1, "boot_id": "trunc')
    assert json.loads(state_file.read_text())["version"] == 1  # a good state was written again

    state_file.unlink()
    with KmsgDaemon(state, tok) as third:
        before, after, _, _ = run_round(third, [NO_MEMORY.format(tok=tok)] * 2)
        assert deltas(before, after, KEYS[:1])[KEYS[0]] == 2
    assert f"no kmsg state file at {state_file}" in third.log()


def test_ring_buffer_overrun_is_counted_as_missed_and_reading_goes_on(tmp_path):
    # Stop the daemon, overwrite the whole 128 KiB ring buffer behind its read position, continue it:
    # its next read gets EPIPE. Every sequence number must then be either read or counted missed.
    tok = f"memtel-o-{uuid.uuid4().hex[:12]}"
    filler = [f"memtel overrun filler {tok} {i:05d} " + "x" * 90 for i in range(1500)]
    with KmsgDaemon(tmp_path / "state", tok) as daemon, KmsgTap() as tap:
        before, start = daemon.sync()
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            write_kmsg(filler, pace_every=100, pace_seconds=0.005)  # paced so the test's own reader keeps up
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        after, end = daemon.sync()
    seq_start, seq_end = tap.seq_of(start), tap.seq_of(end)
    missed = (value(after, "memtel_kernel_kmsg_missed_records_total")
              - value(before, "memtel_kernel_kmsg_missed_records_total"))
    records = value(after, "memtel_kernel_kmsg_records_total") - value(before, "memtel_kernel_kmsg_records_total")
    assert missed > 0
    assert records + missed == seq_end - seq_start
    assert "ring buffer overran" in daemon.log()
