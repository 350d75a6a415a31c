"""The flight recorder in the real daemon: SIGKILLs at random points, a simulated reboot (boot id changed
through --proc-root), a full file system on a small tmpfs, `memtel flight show`, and its configuration.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from telemetry.flight.recorder import CURRENT_RING, HEADROOM_SERIES, PREVIOUS_RING, FlightRecorder, series_key
from telemetry.flight.ring import read_ring
from tests.daemon.helpers import ROOT, Daemon, all_started, check_config, run_cli, static_exporter, wait_for
from tests.support.cli import call_main
from tests.support.tmpfs import SmallTmpfs, fill

PROC = Path(__file__).parents[1] / "fixtures" / "proc"
MIB = 1024**2


def proc_root(tmp_path: Path, boot_id: str) -> Path:
    """A /proc made of real captures (meminfo and buddyinfo taken together), with a boot id we control."""
    proc = tmp_path / "proc"
    (proc / "pressure").mkdir(parents=True, exist_ok=True)
    (proc / "sys/kernel/random").mkdir(parents=True, exist_ok=True)
    shutil.copy(PROC / "meminfo.x86_64-debian12-24g-with-buddyinfo", proc / "meminfo")
    shutil.copy(PROC / "buddyinfo.x86_64-debian12-24g", proc / "buddyinfo")
    shutil.copy(PROC / "vmstat.x86_64-debian12-24g", proc / "vmstat")
    shutil.copy(PROC / "pressure-memory.x86_64-debian12-24g", proc / "pressure" / "memory")
    (proc / "sys/kernel/random/boot_id").write_text(boot_id + "\n")
    return proc


def daemon(tmp_path: Path, state: Path, proc: Path, *extra: str, interval: float | None = None,
           duration: float | None = None) -> Daemon:
    kmsg = tmp_path / "kmsg"
    kmsg.touch()
    args = ["--proc-root", str(proc), "--kmsg", str(kmsg), "--disable-collector", "nvml",
            "--disable-collector", "processes", *extra]
    if interval is not None or duration is not None:
        config = tmp_path / f"flight-{interval}-{duration}.yaml"
        config.write_text(f"flight:\n  interval_seconds: {interval or 1.0}\n  duration_seconds: {duration or 900}\n")
        args += ["--config", str(config)]
    return Daemon(state, *args)


def kill(d: Daemon) -> None:
    assert d.proc is not None
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(10)
    d._log.close()


# -- SIGKILL ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_every_record_written_before_a_sigkill_reads_back_in_order_none_twice(tmp_path):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    proc = proc_root(tmp_path, "sigkill-boot")
    state = tmp_path / "state"
    ring = state / "flight" / CURRENT_RING
    seen: dict[int, float] = {}
    torn = 0
    kills = 12  # each a daemon start (~1 s); the seed varies the timing of every kill from run to run
    for i in range(kills):
        d = daemon(tmp_path, state, proc, interval=0.01, duration=60).start()  # 100 records/s
        time.sleep(rng.uniform(0.05, 0.5))
        oracle = d.scrape().value("memtel_flight_last_record_timestamp_seconds")  # written and fdatasynced
        time.sleep(rng.uniform(0.0, 0.02))
        kill(d)
        contents = read_ring(ring)
        seqs = [r.seq for r in contents.records]
        times = [r.time for r in contents.records]
        context = f"seed {seed}, kill {i + 1}"
        assert seqs == list(range(len(seqs))), context  # in order, none twice, none lost across restarts
        assert times == sorted(set(times)), context
        assert oracle is not None and oracle in set(times), context  # the last record it reported is there
        by_seq = dict(zip(seqs, times, strict=True))
        assert all(by_seq.get(seq) == t for seq, t in seen.items()), context  # nothing before a kill changed
        assert len(seqs) > len(seen), context
        seen = by_seq
        torn += contents.corrupt
    print(f"{kills} SIGKILLs (seed {seed}): {len(seen)} records read back, {torn} torn head record(s) skipped")
    assert len(seen) > kills * 3  # records from every run
    # A torn record (killed mid-write) may be left at the head; the next start overwrites it, so at most one
    # per kill is ever seen, and none stays.
    assert torn <= kills


# -- a reboot ---------------------------------------------------------------------------------------------
def test_after_a_reboot_the_last_boots_records_stay_readable(tmp_path):
    state = tmp_path / "state"
    proc = proc_root(tmp_path, "boot-before-the-crash")
    first = daemon(tmp_path, state, proc, interval=0.1, duration=60).start()
    wait_for(lambda: (first.scrape().value("memtel_flight_records_written_total") or 0) >= 5, what="5 records")
    kill(first)  # the host wedges: no clean shutdown
    before = read_ring(state / "flight" / CURRENT_RING)
    assert before.header.boot_id == "boot-before-the-crash" and len(before.records) >= 5

    (proc / "sys/kernel/random/boot_id").write_text("boot-after\n")
    with daemon(tmp_path, state, proc, interval=0.1, duration=60) as second:
        scrape = wait_for(lambda: (s := second.scrape()).value("memtel_flight_records_written_total") and s,
                          what="a record of the new boot")
    assert scrape.value("memtel_flight_previous_boot_last_record_timestamp_seconds") == before.records[-1].time
    assert scrape.value("memtel_flight_previous_boot_records") == len(before.records)
    # every record held the headroom of the captured /proc: MemAvailable (no huge-page fault fell back)
    assert scrape.value("memtel_flight_previous_boot_min_headroom_bytes") == 24142580 * 1024
    assert "boot id changed" in second.log()

    previous = show(state, "--boot", "previous", "--json")
    lines = [json.loads(line) for line in previous.stdout.splitlines()]
    assert [line["seq"] for line in lines] == [r.seq for r in before.records]
    assert {line["boot_id"] for line in lines} == {"boot-before-the-crash"}
    assert lines[-1]["values"][HEADROOM_SERIES] == 24142580 * 1024
    current = show(state, "--json")
    assert {json.loads(line)["boot_id"] for line in current.stdout.splitlines()} == {"boot-after"}
    assert read_ring(state / "flight" / PREVIOUS_RING).records == before.records


# -- a full file system -----------------------------------------------------------------------------------
@pytest.fixture
def small_tmpfs(tmp_path):
    with SmallTmpfs(tmp_path / "tmpfs", 2 * MIB) as mount:
        yield mount


def test_no_room_for_the_ring_stops_recording_says_so_and_the_exporter_keeps_serving(tmp_path, small_tmpfs):
    state = small_tmpfs / "state"
    proc = proc_root(tmp_path, "full-disk-boot")
    with daemon(tmp_path, state, proc) as d:  # the default 15-minute ring (3.7 MB) cannot fit in 2 MiB
        scrape = wait_for(lambda: (s := d.scrape()).value("memtel_flight_write_failures_total") and s,
                          what="a failed ring creation")
        time.sleep(1.5)
        again = d.scrape()
        log = d.log()
    assert scrape.value("memtel_flight_recording") == 0
    assert again.value("memtel_flight_recording") == 0
    assert again.value("memtel_node_unified_headroom_bytes") == 24142580 * 1024  # the node signals are still served
    assert log.count("recording stopped") == 1 and "No space left on device" in log
    assert "Traceback" not in log
    assert list((state / "flight").iterdir()) == []  # no half-written ring or temporary file left behind


def test_a_disk_that_fills_up_later_does_not_stop_the_recording(tmp_path, small_tmpfs):
    state = small_tmpfs / "state"
    proc = proc_root(tmp_path, "fills-later-boot")
    with daemon(tmp_path, state, proc, interval=0.2, duration=60) as d:  # 300 slots: 1.2 MB, preallocated
        wait_for(lambda: (d.scrape().value("memtel_flight_records_written_total") or 0) >= 2, what="2 records")
        fill(small_tmpfs)  # to the last byte
        with pytest.raises(OSError, match="No space left"):
            (small_tmpfs / "one-more").write_bytes(b"x" * 4096)
        written = d.scrape().value("memtel_flight_records_written_total")
        wait_for(lambda: d.scrape().value("memtel_flight_records_written_total") >= written + 5,
                 what="5 more records on a full file system")
        scrape = d.scrape()
    assert scrape.value("memtel_flight_recording") == 1
    assert scrape.value("memtel_flight_write_failures_total") == 0
    assert read_ring(state / "flight" / CURRENT_RING).corrupt == 0


# -- memtel flight show -----------------------------------------------------------------------------------
def show(state: Path, *args: str, prelude: str = "") -> subprocess.CompletedProcess:
    """`memtel flight show` in this process (`call_main`); with a `prelude` (code run first) or `--plot`
    (matplotlib stays out of the test process) through a fresh Python, for the exit status the shell sees."""
    argv = ["flight", "show", "--state-dir", str(state), *args]
    if not prelude and "--plot" not in args:
        return call_main(argv)
    code = f"import sys; {prelude or 'pass'}; from telemetry.cli import main; sys.exit(main({argv!r}))"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.fixture
def recorded(tmp_path) -> Path:
    """A state directory whose ring holds 30 records, one a second: headroom falling 29 → 2.5 GiB, NV_ERR at the end."""
    clock = iter(1_800_000_000.0 + i for i in range(1_000))
    recorder = FlightRecorder(tmp_path / "state" / "flight", "show-boot", clock=lambda: next(clock),
                              duration_seconds=120)
    for i in range(30):
        headroom = 29 * 1024**3 - i * (26.5 * 1024**3 / 29)
        assert recorder.record({
            HEADROOM_SERIES: headroom, "memtel_node_mem_available_bytes": 40 * 1024**3,
            "memtel_node_mem_free_contiguous_bytes": headroom, "memtel_node_mem_unaccounted_bytes": 80 * 1024**3,
            series_key("memtel_gpu_power_watts", {"gpu": "0", "uuid": "GPU-1"}): 90.0,
            "memtel_kernel_nv_err_no_memory_total": 0.0 if i < 27 else float(i - 26)})
    return tmp_path / "state"


def test_show_prints_a_table_of_the_signals_that_matter(recorded):
    result = show(recorded)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("boot show-boot: 30 record(s)")
    assert "headroom GiB" in lines[1] and "GPU power W" in lines[1]
    assert lines[2].split()[1] == "29.00" and lines[-1].split()[1] == "2.50"  # headroom, first and last
    assert lines[-1].split()[-2] == "3"  # NV_ERR lines so far
    assert result.stderr == ""


def test_show_last_json_and_csv(recorded):
    last = show(recorded, "--last", "4s", "--json")
    records = [json.loads(line) for line in last.stdout.splitlines()]
    assert [r["seq"] for r in records] == [25, 26, 27, 28, 29]
    csv = show(recorded, "--csv").stdout.splitlines()
    header = csv[0].split(",")
    assert header[:2] == ["seq", "time"] and HEADROOM_SERIES in header and len(csv) == 31
    assert '"memtel_gpu_power_watts{gpu=""0"",uuid=""GPU-1""}"' in csv[0]  # label quotes escaped for CSV


def test_show_plots_a_png(recorded, tmp_path):
    pytest.importorskip("matplotlib", reason="the harness extra (matplotlib) is installed by scripts/test")
    out = tmp_path / "last-boot.png"
    result = show(recorded, "--plot", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("args", "prelude", "code", "message"), [
    (("--plot", "x.png"), "sys.modules['matplotlib'] = None", 1, "needs matplotlib, which the harness extra installs"),
    (("--plot", "/"), "pass", 2, "expected a file name"),
    (("--last", "soon"), "", 2, "is not a duration"),
    (("--boot", "previous"), "", 2, "no ring of an earlier boot has been kept yet"),
])
def test_show_bad_input_is_one_line(recorded, tmp_path, args, prelude, code, message):
    args = tuple(str(tmp_path / a) if a == "x.png" else a for a in args)
    result = show(recorded, *args, prelude=prelude)
    assert result.returncode == code
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_show_a_damaged_ring(recorded):
    ring = recorded / "flight" / CURRENT_RING
    data = bytearray(ring.read_bytes())
    header = read_ring(ring).header
    data[header.slot_offset(29) + 30] ^= 0xFF  # one flipped bit in the newest record
    ring.write_bytes(bytes(data))
    result = show(recorded, "--json")
    assert result.returncode == 0
    assert len(result.stdout.splitlines()) == 29
    assert "skipped 1 torn or corrupt record(s)" in result.stderr and len(result.stderr.splitlines()) == 1
    ring.write_bytes(b"garbage" * 100)
    result = show(recorded)
    assert result.returncode == 1 and "is not a readable flight ring" in result.stderr
    assert "Traceback" not in result.stderr


# -- configuration ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("yaml", "flags", "message"), [
    ("flight:\n  interval_seconds: 0\n", (), "flight.interval_seconds: expected a number from 0.01"),
    ("flight:\n  duration_seconds: .nan\n", (), "flight.duration_seconds"),
    ("flight:\n  duration_seconds: 604800\n  interval_seconds: 0.01\n", (), "at most 100000"),
    ("flight:\n  hook_targets: [nowhere]\n", (), "flight.hook_targets[0]"),
    ("flight:\n  enabled: sometimes\n", (), "flight.enabled: expected true or false"),
    ("flight:\n  speed: 3\n", (), "unknown key(s) speed"),
    ("", ("--flight-duration", "forever"), "--flight-duration: 'forever' is not a duration"),
    ("", ("--flight-duration", "1s"), "--flight-duration: expected a number from 10"),
])
def test_bad_flight_configuration_is_one_line(tmp_path, yaml, flags, message):
    """In this process through the CLI's entry function; the first case also through the console script, for
    the exit status and the line the shell sees."""
    config = tmp_path / "daemon.yaml"
    config.write_text(yaml or "{}\n")
    result = check_config("--config", str(config), *flags)
    assert result.returncode == 2, result.stdout
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    if "interval_seconds: 0" in yaml:
        shell = run_cli("--config", str(config), *flags, "--check-config")
        assert (shell.returncode, shell.stdout, shell.stderr) == (2, "", result.stderr)


def test_the_recorder_is_on_with_a_state_dir_and_off_when_asked(tmp_path):
    proc = proc_root(tmp_path, "on-off-boot")
    with all_started(daemon(tmp_path, tmp_path / "on", proc),
                     daemon(tmp_path, tmp_path / "off", proc, "--no-flight-recorder")) as (on, off):
        assert wait_for(lambda: on.scrape().value("memtel_flight_records_written_total"), what="a record")
        scrape = off.scrape()
    assert scrape.value("memtel_flight_recording") is None
    assert not (tmp_path / "off" / "flight").exists()


def _config(*argv: str):
    import argparse

    from telemetry.daemon.cli import configure
    from telemetry.daemon.config import from_args

    parser = argparse.ArgumentParser()
    configure(parser)
    return from_args(parser.parse_args(list(argv)))


def test_when_the_recorder_is_on(tmp_path, monkeypatch):
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    yaml_with = tmp_path / "with.yaml"
    yaml_with.write_text(f"state_dir: {tmp_path / 's'}\n")
    yaml_off = tmp_path / "off.yaml"
    yaml_off.write_text(f"state_dir: {tmp_path / 's'}\nflight:\n  enabled: false\n")
    yaml_on = tmp_path / "on.yaml"
    yaml_on.write_text("flight:\n  enabled: true\n  duration_seconds: 120\n")
    assert not _config().flight_enabled  # no state directory given: nothing is written unasked
    assert _config("--state-dir", str(tmp_path)).flight_enabled
    assert _config("--config", str(yaml_with)).flight_enabled
    assert not _config("--config", str(yaml_off)).flight_enabled
    assert not _config("--state-dir", str(tmp_path), "--no-flight-recorder").flight_enabled
    on = _config("--config", str(yaml_on), "--flight-duration", "30m")
    assert on.flight_enabled and on.flight.duration_seconds == 1800
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "systemd"))  # systemd's StateDirectory=
    assert _config().flight_enabled


def test_records_keep_the_last_values_of_a_local_hook_exporter(tmp_path):
    body = (b'# TYPE memtel_allocator_reserved_bytes gauge\n'
            b'memtel_allocator_reserved_bytes{site="indexer",rank="0"} 7.5e+09\n'
            b'# TYPE memtel_hook_calls_total counter\nmemtel_hook_calls_total{rank="0"} 3.0\n')
    state = tmp_path / "state"
    with static_exporter(body) as target:
        config = tmp_path / "hooks.yaml"
        config.write_text(f"flight:\n  interval_seconds: 0.2\n  duration_seconds: 60\n  hook_targets: ['{target}']\n")
        key = f'memtel_allocator_reserved_bytes{{rank="0",site="indexer",target="{target}"}}'
        with daemon(tmp_path, state, proc_root(tmp_path, "hook-boot"), "--config", str(config)):
            ring = state / "flight" / CURRENT_RING   # made by the recorder's first write: poll until it is there
            wait_for(lambda: ring.exists() and any(key in r.values for r in read_ring(ring).records),
                     what="a record with the hook's series")
    records = read_ring(state / "flight" / CURRENT_RING).records
    with_hook = [r for r in records if key in r.values]
    assert with_hook and all(r.values[key] == 7.5e9 for r in with_hook)
    assert not any("memtel_hook_calls_total" in k for r in records for k in r.values)  # only allocator/host series
    assert HEADROOM_SERIES in with_hook[-1].values  # beside the node's own signals
