"""The real daemon as a subprocess: endpoints, MemAvailable, faults, bad input, clean shutdown."""

import os
import shutil
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from telemetry.procfs.meminfo import parse_meminfo
from tests.daemon.helpers import Daemon, check_config, run_cli, wait_for

PROC = Path(__file__).parents[1] / "fixtures" / "proc"


def test_scrape_endpoints_and_mem_available_matches_proc(tmp_path):
    (tmp_path / "kern.log").touch()
    with Daemon(tmp_path / "state", "--kmsg", str(tmp_path / "kern.log")) as daemon:
        scrape = daemon.scrape()
        fresh = parse_meminfo(Path("/proc/meminfo").read_text())
        available = scrape.value("memtel_node_mem_available_bytes")
        assert abs(available - fresh["MemAvailable"]) <= 0.05 * fresh["MemAvailable"]
        assert scrape.value("memtel_node_mem_total_bytes") == fresh["MemTotal"]
        assert scrape.value("memtel_node_swap_used_bytes") == fresh["SwapTotal"] - fresh["SwapFree"]
        assert scrape.value("memtel_node_vmstat_pswpin_total") is not None
        for name in ("meminfo", "vmstat", "processes", "kmsg"):
            assert scrape.value("memtel_collector_success", collector=name) == 1, name
            assert scrape.value("memtel_collector_duration_seconds", collector=name) >= 0
        if Path("/proc/pressure/memory").exists():
            assert scrape.value("memtel_collector_success", collector="pressure") == 1
            assert scrape.value("memtel_node_pressure_memory_some_seconds_total") is not None
        assert scrape.value("memtel_kernel_nv_err_no_memory_total") == 0
        scrapes = scrape.value("memtel_exporter_scrapes_total")
        assert scrapes == daemon.scrape().value("memtel_exporter_scrapes_total") - 1
        health = httpx.get(daemon.url + "/healthz").json()
        assert health["status"] == "ok" and health["collectors"]["meminfo"]["success"] is True
        assert httpx.get(daemon.url + "/nope").status_code == 404
        assert daemon.stop() == 0
    assert "stopping (SIGTERM)" in daemon.log()


def test_faults_nvml_absent_kmsg_unreadable_and_a_raising_collector(tmp_path):
    # A /proc copy whose vmstat is garbage (its collector raises) and without pressure/ (its file is missing).
    proc = tmp_path / "proc"
    (proc / "sys/kernel/random").mkdir(parents=True)
    shutil.copy(PROC / "meminfo.x86_64-debian12-24g", proc / "meminfo")
    (proc / "vmstat").write_text("this is not vmstat\n")
    (proc / "sys/kernel/random/boot_id").write_text("test-boot\n")
    unreadable = tmp_path / "a-directory"
    unreadable.mkdir()
    with Daemon(tmp_path / "state", "--proc-root", str(proc), "--kmsg", str(unreadable)) as daemon:
        # the kmsg follower tries to open the log right after start: poll until it has failed
        scrape = wait_for(lambda: (s := daemon.scrape()).value("memtel_collector_success", collector="kmsg") == 0
                          and s, what="the kmsg collector failed")  # status 200 checked inside
        success = {name: scrape.value("memtel_collector_success", collector=name)
                   for name in ("meminfo", "vmstat", "pressure", "nvml", "processes", "kmsg")}
        assert success["meminfo"] == 1
        assert success["vmstat"] == 0 and success["pressure"] == 0 and success["kmsg"] == 0
        assert not any(n.startswith("memtel_node_vmstat_") for n in scrape.names())  # omitted, not zeroed
        assert not any(n.startswith("memtel_kernel_") for n in scrape.names())
        assert scrape.value("memtel_node_mem_total_bytes") > 20 * 2**30  # read from the fixture
        try:
            import pynvml

            pynvml.nvmlInit()
            nvml_present = True
        except Exception:
            nvml_present = False
        if not nvml_present:
            assert success["nvml"] == 0 and scrape.value("memtel_gpu_nvml_available") == 0
    log = daemon.log()
    assert f"cannot read the kernel log {unreadable}: it is a directory" in log
    assert "collector vmstat failed" in log


def test_bad_input_exits_non_zero_with_a_clear_message(tmp_path):
    """The configuration's refusals in this process (`check_config`: the same path up to --check-config); the
    bad pattern through the console script, with a state directory that must stay unmade."""
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("listen: [\n")
    result = check_config("--config", str(bad_yaml))
    assert result.returncode == 2 and "not valid YAML" in result.stderr and str(bad_yaml) in result.stderr

    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("kmsg:\n  burst_windw_seconds: 3\n")
    result = check_config("--config", str(unknown))
    assert result.returncode == 2 and "unknown key(s) burst_windw_seconds" in result.stderr

    result = run_cli("--kmsg-pattern", "oops=[unclosed", "--state-dir", str(tmp_path / "s"))
    assert result.returncode == 2 and "bad regular expression '[unclosed'" in result.stderr
    assert not (tmp_path / "s").exists()  # nothing half-started

    result = check_config("--listen", "localhost")
    assert result.returncode == 2 and "'localhost' is not HOST:PORT" in result.stderr


def test_port_in_use_exits_with_a_clear_error_and_nothing_started(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        started = time.monotonic()
        result = run_cli("--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "state"))
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "stop it or choose another port" in result.stderr  # the one wording of every server command
    assert not (tmp_path / "state").exists()  # the kmsg follower never started, no state written
    assert time.monotonic() - started < 20


def test_check_config(tmp_path):
    example = Path(__file__).parents[2] / "configs" / "examples" / "daemon.yaml"
    result = check_config("--config", str(example))
    assert result.returncode == 0 and "configuration OK" in result.stdout


def _dmesg_restricted() -> bool:
    return Path("/proc/sys/kernel/dmesg_restrict").read_text().strip() == "1"


@pytest.mark.skipif(shutil.which("setpriv") is None or os.geteuid() != 0, reason="needs root and setpriv (util-linux)")
def test_kmsg_needs_cap_syslog_and_only_that(tmp_path):
    """The systemd unit grants CAP_SYSLOG only. Without it (dmesg_restrict=1) the kmsg collector fails and
    the rest keeps working; with CAP_SYSLOG as the only capability every collector works."""
    if _dmesg_restricted():
        without = ("setpriv", "--bounding-set=-syslog", "--inh-caps=-all")
        with Daemon(tmp_path / "a", "--disable-collector", "nvml", prefix=without) as daemon:
            scrape = wait_for(lambda: (s := daemon.scrape()).value("memtel_collector_success", collector="kmsg")
                              == 0 and s, what="the kmsg collector failed")
            assert scrape.value("memtel_collector_success", collector="kmsg") == 0
            assert scrape.value("memtel_collector_success", collector="meminfo") == 1
            assert scrape.value("memtel_kernel_nv_err_no_memory_total") is None
        assert "cannot read the kernel log /dev/kmsg: Operation not permitted" in daemon.log()
        assert "CAP_SYSLOG" in daemon.log()
    only = ("setpriv", "--bounding-set=-all,+syslog", "--inh-caps=-all")
    with Daemon(tmp_path / "b", "--disable-collector", "nvml", prefix=only) as daemon:
        scrape = wait_for(lambda: ((s := daemon.scrape()).value("memtel_kernel_kmsg_records_total") or 0) > 0
                          and s, what="kernel log records counted")
        for name in ("meminfo", "vmstat", "processes", "kmsg"):
            assert scrape.value("memtel_collector_success", collector=name) == 1, name
        assert scrape.value("memtel_kernel_kmsg_records_total") > 0


def test_unusable_state_dir_and_sigint(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    result = run_cli("--listen", "127.0.0.1:0", "--state-dir", str(not_a_dir / "state"))
    assert result.returncode == 2 and f"cannot use state directory {not_a_dir / 'state'}" in result.stderr

    daemon = Daemon(tmp_path / "state", "--kmsg", str(not_a_dir)).start()
    try:
        daemon.proc.send_signal(signal.SIGINT)
        assert daemon.proc.wait(10) == 130  # Ctrl-C, as every command (docs/cli.md); SIGTERM stops it with 0
    finally:
        daemon.stop()
    assert "stopping (SIGINT)" in daemon.log() and "stopped" in daemon.log()
