"""Issue 19, item 4: one damaged header byte hid the whole flight ring.

Before: a ring whose header failed its checks raised RingFormatError, the recorder moved it aside and no
tool read it back. Now every record whose own checksum holds is recovered, and `memtel flight show --file`
reads a moved-aside ring.
"""

from __future__ import annotations

import logging
import time

import pytest

from telemetry.cli import main
from telemetry.flight.recorder import CURRENT_RING, HEADROOM_SERIES, PREVIOUS_RING
from telemetry.flight.ring import HEADER_BYTES, RECORD_MAGIC, RingFormatError, read_ring
from tests.daemon.test_flight_recorder import node_values, recorder, write

DAMAGE = {
    "magic": lambda b: b"NOTARING" + b[8:],
    "version": lambda b: b[:8] + b"\x07" + b[9:],
    "json_byte": lambda b: b[:30] + bytes([b[30] ^ 0xFF]) + b[31:],
    "zeroed": lambda b: bytes(len(b)),
    "shortened": lambda b: b[:100],  # the slots now start 3,996 bytes early: no longer on a 4 KiB boundary
}


def _damage(path, how) -> None:
    data = path.read_bytes()
    path.write_bytes(DAMAGE[how](data[:HEADER_BYTES]) + data[HEADER_BYTES:])


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_one_damaged_header_byte_hides_the_whole_flight_ring(tmp_path, how):
    write(recorder(tmp_path), 75)  # a 60-slot ring that has wrapped: slots 0-14 hold records 60-74
    path = tmp_path / CURRENT_RING
    intact = read_ring(path)
    _damage(path, how)
    recovered = read_ring(path)
    assert recovered.header_damage is not None and intact.header_damage is None
    assert [(r.seq, r.time, r.values) for r in recovered.records] == \
        [(r.seq, r.time, r.values) for r in intact.records]
    assert [r.seq for r in recovered.records] == list(range(15, 75))
    assert recovered.header.interval_seconds == pytest.approx(1.0)
    assert recovered.header.slot_bytes == intact.header.slot_bytes


def test_a_damaged_record_beside_a_damaged_header_is_skipped_and_counted(tmp_path):
    write(recorder(tmp_path), 5)
    path = tmp_path / CURRENT_RING
    data = bytearray(path.read_bytes())
    slot = read_ring(path).header.slot_bytes
    data[HEADER_BYTES + 2 * slot + 30] ^= 0xFF  # inside record 2's payload
    data[20] ^= 0xFF
    path.write_bytes(bytes(data))
    contents = read_ring(path)
    assert [r.seq for r in contents.records] == [0, 1, 3, 4] and contents.corrupt == 1


def test_a_file_full_of_record_magic_is_refused_in_bounded_time(tmp_path):
    path = tmp_path / "hostile.ring"
    path.write_bytes(b"garbage!" + (RECORD_MAGIC + b"\xff\xff\x0f\x00") * (1 << 19))  # 4 MiB, lengths of 1 MiB
    started = time.monotonic()
    with pytest.raises(RingFormatError, match="no record was found"):
        read_ring(path)
    assert time.monotonic() - started < 5


def test_the_recorder_moves_a_damaged_ring_aside_and_flight_show_reads_it(tmp_path, caplog, capsys):
    write(recorder(tmp_path), 4)
    _damage(tmp_path / CURRENT_RING, "json_byte")
    caplog.set_level(logging.INFO)
    write(recorder(tmp_path), 1)  # the next daemon start: a new ring, the damaged one kept aside
    (aside,) = tmp_path.glob(f"{CURRENT_RING}.corrupt-*")
    (line,) = [r.getMessage() for r in caplog.records if "damaged header" in r.getMessage()]
    assert "4 record(s)" in line and f"memtel flight show --file {aside}" in line
    assert main(["flight", "show", "--file", str(aside), "--json"]) == 0
    out, err = capsys.readouterr()
    assert [int(line.split('"seq": ')[1].split(",")[0]) for line in out.splitlines()] == [0, 1, 2, 3]
    assert err.count("\n") == 1 and "the header is damaged" in err and "4 record(s)" in err
    assert main(["flight", "show", "--file", str(aside), "--boot", "previous"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_damaged_previous_ring_still_gives_the_last_boots_summary(tmp_path):
    write(recorder(tmp_path, "boot-a"), 3)
    write(recorder(tmp_path, "boot-b"), 1)  # a new boot: boot-a's ring becomes previous.ring
    _damage(tmp_path / PREVIOUS_RING, "magic")
    again = recorder(tmp_path, "boot-b")
    again.prepare()
    assert again.previous is not None and again.previous.records == 3
    assert again.previous.min_headroom_bytes == min(node_values(i)[HEADROOM_SERIES] for i in range(3))
    assert len(list(tmp_path.glob(f"{PREVIOUS_RING}.corrupt-*"))) == 1
