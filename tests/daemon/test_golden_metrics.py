"""Golden end-to-end output: the real daemon on fixture files, /metrics compared with a checked-in file
(catches a renamed or dropped series that dashboards and alerts rely on), then linted with promtool.

Regenerate after an intended change: MEMTEL_UPDATE_GOLDEN=1 pytest tests/daemon/test_golden_metrics.py
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.daemon.helpers import Daemon, wait_for

FIXTURES = Path(__file__).parents[1] / "fixtures"
GOLDEN = FIXTURES / "daemon" / "metrics.x86_64-debian12-24g__dgx-spark-kmsg.prom"
# Values that differ on every run: times, durations, counts of scrapes and connections, the process's own
# figures (process_*), the Python and memtel versions.
_VOLATILE = re.compile(
    r"^(memtel_collector_duration_seconds|memtel_exporter_start_time_seconds|memtel_exporter_scrapes_total|"
    r"memtel_\w+_last_seen_timestamp_seconds|memtel_exporter_http_\w+|process_\w+|"
    r"memtel_flight_last_\w+|memtel_flight_records_written_total)(\{[^}]*\})? .*$"
)


def _normalise(text: str) -> str:
    lines = []
    for line in text.splitlines():
        line = _VOLATILE.sub(lambda m: f"{m.group(1)}{m.group(2) or ''} <volatile>", line)
        line = re.sub(r'(python|version)="[^"]*"', r'\1="<volatile>"', line)
        lines.append(line)
    return "\n".join(lines) + "\n"


def _fixture_daemon(tmp_path: Path) -> Daemon:
    proc = tmp_path / "proc"
    (proc / "pressure").mkdir(parents=True)
    (proc / "sys/kernel/random").mkdir(parents=True)
    shutil.copy(FIXTURES / "proc" / "meminfo.x86_64-debian12-24g", proc / "meminfo")
    shutil.copy(FIXTURES / "proc" / "vmstat.x86_64-debian12-24g", proc / "vmstat")
    shutil.copy(FIXTURES / "proc" / "pressure-memory.x86_64-debian12-24g", proc / "pressure" / "memory")
    shutil.copy(FIXTURES / "proc" / "buddyinfo.x86_64-debian12-24g", proc / "buddyinfo")
    (proc / "sys/kernel/random/boot_id").write_text("golden-boot\n")
    return Daemon(tmp_path / "state", "--proc-root", str(proc),
                  "--kmsg", str(FIXTURES / "kmsg" / "dgx-spark__gb10__580.142.kmsg"),
                  "--kmsg-pattern", "uvm=nvidia-uvm", "--disable-collector", "nvml",
                  "--disable-collector", "processes")


@pytest.fixture(scope="module")
def fixture_scrape(tmp_path_factory) -> str:
    """The /metrics text of one daemon on the fixtures, once it has read them all and recorded (both tests
    read only this text)."""
    with _fixture_daemon(tmp_path_factory.mktemp("golden")) as daemon:
        wait_for(lambda: daemon.scrape().value("memtel_kernel_kmsg_records_total") == 31, what="fixture read")
        wait_for(lambda: daemon.scrape().value("memtel_flight_recording") == 1, what="a flight record")
        return daemon.scrape().text


def test_metrics_match_the_golden_file(fixture_scrape):
    got = _normalise(fixture_scrape)
    if os.environ.get("MEMTEL_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(got)
    assert got == GOLDEN.read_text()


@pytest.mark.prometheus
def test_promtool_finds_no_problems(fixture_scrape):
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: apt-get install -y prometheus (scripts/test does it)"
    result = subprocess.run([promtool, "check", "metrics"], input=fixture_scrape, capture_output=True, text=True)
    problems = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert problems == []
