"""The kernel-log position survives a lost state directory (issue 38, telemetry/daemon/kmsg/position.py): a
daemon that starts without its state file resumes after the record the last daemon of this boot counted,
with counters from 0, instead of counting every old NV_ERR_NO_MEMORY line again (a 15-minute ticket)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from telemetry.daemon.kmsg.classify import Classifier
from telemetry.daemon.kmsg.counts import KmsgCounts
from telemetry.daemon.kmsg.follower import KmsgFollower
from telemetry.daemon.kmsg.position import (
    POSITION_FILE_NAME,
    Position,
    default_position_path,
    load_position,
    save_position,
)
from telemetry.daemon.kmsg.state import STATE_FILE_NAME

NV_ERR = "3,{seq},{usec},-;NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051)\n"


def follow(log: Path, state_dir: Path, position: Path | None, boot_id: str = "boot-a") -> KmsgFollower:
    follower = KmsgFollower(str(log), Classifier(), KmsgCounts(window_seconds=0.0), state_path=state_dir /
                            STATE_FILE_NAME, boot_id=boot_id, position_path=position)
    follower.load_state()
    follower.start()
    return follower


def wait_records(follower: KmsgFollower, n: int) -> None:
    deadline = time.monotonic() + 5
    while follower.counts.snapshot().records < n:
        assert time.monotonic() < deadline, follower.counts.snapshot()
        time.sleep(0.02)


@pytest.fixture
def three_old_lines(tmp_path) -> tuple[Path, Path]:
    """A kernel log with three NV_ERR lines a first daemon counted, its state directory then lost."""
    log = tmp_path / "kern.kmsg"
    log.write_text("".join(NV_ERR.format(seq=seq, usec=seq * 1000) for seq in (10, 11, 12)))
    first_state = tmp_path / "state-1"
    first_state.mkdir()
    first = follow(log, first_state, tmp_path / "run" / POSITION_FILE_NAME)
    wait_records(first, 3)
    first.stop()
    for path in first_state.iterdir():   # the state directory is lost
        path.unlink()
    return log, tmp_path


def test_a_daemon_that_lost_its_state_counts_nothing_old_and_everything_new(three_old_lines):
    log, tmp = three_old_lines
    second = follow(log, tmp / "state-1", tmp / "run" / POSITION_FILE_NAME)
    try:
        with open(log, "a") as f:
            f.write(NV_ERR.format(seq=13, usec=13_000))
        wait_records(second, 1)
        time.sleep(0.2)
        snap = second.counts.snapshot()
        assert snap.lines["nv_err_no_memory"] == 1 and snap.records == 1 and snap.missed == 0
    finally:
        second.stop()


def test_without_the_position_the_old_lines_are_counted_again(three_old_lines):
    """What it fixes: the same restart with no position counts the three old lines as new."""
    log, tmp = three_old_lines
    second = follow(log, tmp / "state-1", None)
    try:
        wait_records(second, 3)
        assert second.counts.snapshot().lines["nv_err_no_memory"] == 3
    finally:
        second.stop()


@pytest.mark.parametrize("boot_id, source, expected", [
    ("boot-a", "/dev/kmsg", 12), ("boot-b", "/dev/kmsg", None), ("boot-a", "/var/log/kern", None),
    ("unknown", "/dev/kmsg", None)])
def test_a_position_is_trusted_only_for_its_own_known_boot_and_source(tmp_path, boot_id, source, expected):
    path = tmp_path / "run" / POSITION_FILE_NAME
    save_position(path, Position("boot-a", "/dev/kmsg", 12, 12_000))
    save_position(tmp_path / "unknown" / POSITION_FILE_NAME, Position("unknown", "/dev/kmsg", 12, 12_000))
    where = tmp_path / ("unknown" if boot_id == "unknown" else "run") / POSITION_FILE_NAME
    position, why = load_position(where, boot_id, source)
    assert (position.last_seq if position else None) == expected, why
    assert (tmp_path / "run").stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("content", [
    b"", b"[]", b'{"boot_id": "boot-a", "source": "s", "last_seq": -1}',
    b'{"boot_id": "boot-a", "source": "s", "last_seq": 1e3}', b'{"boot_id": "boot-a", "source": "s"}',
    b'{"boot_id": "boot-a", "source": "s", "last_seq": 1, "last_usec": NaN}', b"9" * 5000, b"\xff"])
def test_a_position_file_that_is_not_one_is_ignored(tmp_path, content):
    path = tmp_path / POSITION_FILE_NAME
    path.write_bytes(content)
    position, why = load_position(path, "boot-a", "s")
    assert position is None and str(path) in why


def test_a_position_behind_a_symlink_is_not_read(tmp_path):
    real = tmp_path / "real.json"
    save_position(real, Position("boot-a", "s", 5, None))
    link = tmp_path / POSITION_FILE_NAME
    link.symlink_to(real)
    assert load_position(link, "boot-a", "s")[0] is None
    assert json.loads(real.read_text())["last_seq"] == 5


def test_each_state_directory_has_its_own_position(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path / "run"))
    one, other = default_position_path(tmp_path / "a"), default_position_path(tmp_path / "b")
    assert one is not None and other is not None and one != other and one.parent == tmp_path / "run"
    assert one == default_position_path(tmp_path / "a")   # the same directory, after its contents are lost


def test_the_shipped_unit_keeps_the_position_across_service_restarts() -> None:
    """The systemd unit runs the daemon as a dynamic user, where only $RUNTIME_DIRECTORY can hold the position:
    without RuntimeDirectory= (preserved across the service's restarts) a lost state would recount old lines."""
    unit = (Path(__file__).resolve().parents[2] / "configs/systemd/memtel-daemon.service").read_text()
    settings = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#"))
    assert settings.get("RuntimeDirectory") == "memtel"
    assert settings.get("RuntimeDirectoryPreserve") == "yes"
