"""Issue 14: `scripts/test` as root rewrote the machine's kernel log and made a monitoring stack page.

Now a test writes into /dev/kmsg only when MEMTEL_TEST_KMSG=1 (CI's .ci/run sets it), only through
tests/support/kmsg.py, and every line it writes starts with "memtel-test:", which memtel's daemon
reads but counts nowhere unless told to (`--kmsg-count-test-lines`, `kmsg.ignore_test_lines: false`).
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest

from tests.daemon.helpers import ROOT, Daemon, all_started, wait_for
from tests.support import kmsg as test_kmsg

LINES = (
    "NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) returned from x",
    "NVRM: Xid (PCI:0000:01:00): 79, pid=1, name=memtel-test, GPU has fallen off the bus",
    "Out of memory: Killed process 999999 (memtel-test) total-vm:0kB, anon-rss:0kB",
)


def _log_file(tmp_path: Path) -> Path:
    log = tmp_path / "kern.kmsg"
    log.write_text("".join(f"3,{i + 1},{1000 + i},-;{test_kmsg.marked(line)}\n" for i, line in enumerate(LINES)))
    return log


def test_marked_lines_raise_nothing_by_default_and_count_when_asked(tmp_path):
    log = _log_file(tmp_path)
    with all_started(Daemon(tmp_path / "a", "--kmsg", str(log), "--disable-collector", "nvml"),
                     Daemon(tmp_path / "b", "--kmsg", str(log), "--disable-collector", "nvml",
                            *test_kmsg.DAEMON_COUNTS_TEST_LINES)) as (default, counting):
        scrape = wait_for(lambda: (s := default.scrape()).value("memtel_kernel_kmsg_records_total") == 3 and s,
                          what="3 records read")
        counted = wait_for(lambda: (s := counting.scrape()).value("memtel_kernel_kmsg_records_total") == 3 and s,
                           what="3 records read")
    assert scrape.value("memtel_kernel_kmsg_ignored_test_lines_total") == 3
    assert scrape.value("memtel_kernel_nv_err_no_memory_total") == 0
    assert scrape.value("memtel_kernel_nvrm_errors_total") == 0
    assert scrape.value("memtel_kernel_oom_kills_total") == 0
    assert scrape.value("memtel_kernel_xid_total", xid="79") is None
    scrape = counted
    assert scrape.value("memtel_kernel_kmsg_ignored_test_lines_total") == 0
    assert scrape.value("memtel_kernel_nv_err_no_memory_total") == 1
    assert scrape.value("memtel_kernel_xid_total", xid="79") == 1
    assert scrape.value("memtel_kernel_oom_kills_total") == 1


def test_the_config_switch_counts_them_too(tmp_path):
    config = tmp_path / "daemon.yaml"
    config.write_text("kmsg:\n  ignore_test_lines: false\n")
    with Daemon(tmp_path / "s", "--config", str(config), "--kmsg", str(_log_file(tmp_path)),
                "--disable-collector", "nvml") as daemon:
        scrape = wait_for(lambda: (s := daemon.scrape()).value("memtel_kernel_kmsg_records_total") == 3 and s,
                          what="3 records read")
    assert scrape.value("memtel_kernel_nv_err_no_memory_total") == 1


def test_the_marker_goes_after_a_priority_prefix_and_only_once():
    assert test_kmsg.marked("<3>NVRM: x") == "<3>memtel-test: NVRM: x"
    assert test_kmsg.marked("NVRM: x\n") == "memtel-test: NVRM: x"
    assert test_kmsg.marked("memtel-test: y") == "memtel-test: y"


def test_kernel_log_writes_are_opt_in(monkeypatch):
    monkeypatch.delenv(test_kmsg.OPT_IN_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="MEMTEL_TEST_KMSG=1"):
        test_kmsg.write_kmsg(["never written"])


_KMSG_WRITE = re.compile(r"O_WRONLY|O_RDWR|open\([^)]*[\"'][wa]|write_text|write_bytes")


def test_no_test_or_benchmark_writes_the_kernel_log_except_through_the_helper():
    offenders = []
    helper = ROOT / "tests" / "support" / "kmsg.py"
    for path in [*ROOT.glob("tests/**/*.py"), *ROOT.glob("benchmarks/*.py")]:
        if path in (helper, Path(__file__)):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if ("/dev/kmsg" in line or "KMSG" in line) and _KMSG_WRITE.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []


@pytest.mark.kmsg
def test_a_marked_line_in_the_real_kernel_log_is_ignored_by_a_default_daemon(tmp_path):
    token = f"memtel-ignore-{uuid.uuid4().hex[:10]}"
    with Daemon(tmp_path / "default", "--disable-collector", "nvml", "--kmsg-pattern", f"mine={token}") as default, \
            Daemon(tmp_path / "counting", "--disable-collector", "nvml", "--kmsg-pattern", f"mine={token}",
                   *test_kmsg.DAEMON_COUNTS_TEST_LINES) as counting:
        before = default.scrape().value("memtel_kernel_kmsg_ignored_test_lines_total")
        test_kmsg.write_kmsg([f"NVRM: Xid (PCI:0000:01:00): 79, pid=1, name=memtel-test {token}"])
        wait_for(lambda: counting.scrape().value("memtel_kernel_pattern_matches_total", pattern="mine") == 1,
                 what="the counting daemon saw the line")
        scrape = wait_for(lambda: (s := default.scrape()).value("memtel_kernel_kmsg_ignored_test_lines_total")
                          > before and s, what="the default daemon read the line")
        assert scrape.value("memtel_kernel_pattern_matches_total", pattern="mine") == 0
