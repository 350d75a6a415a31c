"""The flight recorder's ring file and `FlightRecorder`, in process: records round-trip in order; torn,
truncated, corrupt and appended bytes are skipped with one log line; boots are kept apart; the ring stays
within its bound over a simulated day; hostile files are refused without following links or exhausting
memory; the hook-exporter scraper keeps the allocator series. The real daemon (SIGKILLs, a full file
system, a reboot) is in test_flight_daemon.py.
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from pathlib import Path

import pytest

from telemetry.flight.hooks import HookScraper, hook_series
from telemetry.flight.recorder import CURRENT_RING, HEADROOM_SERIES, PREVIOUS_RING, FlightRecorder, series_key
from telemetry.flight.ring import (
    HEADER_BYTES,
    MAX_PAYLOAD_JSON_BYTES,
    RECORD_MAGIC,
    RingFormatError,
    RingHeader,
    decode_slot,
    encode_record,
    read_ring,
)
from tests.daemon.helpers import static_exporter


class FakeClock:
    def __init__(self, start: float = 1_800_000_000.0, step: float = 1.0) -> None:
        self.now = start
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def no_sync(fd: int) -> None:
    pass


def recorder(directory: Path, boot: str = "boot-a", **kwargs) -> FlightRecorder:
    kwargs.setdefault("clock", FakeClock())
    kwargs.setdefault("sync", no_sync)
    kwargs.setdefault("duration_seconds", 60)
    return FlightRecorder(directory, boot, **kwargs)


def node_values(i: int) -> dict[str, float]:
    return {HEADROOM_SERIES: 10e9 - i * 1e8, "memtel_node_mem_available_bytes": 20e9,
            series_key("memtel_gpu_power_watts", {"gpu": "0", "uuid": "GPU-1"}): 40.0 + i}


def write(rec: FlightRecorder, count: int, start: int = 0) -> None:
    for i in range(start, start + count):
        assert rec.record(node_values(i))


def test_records_read_back_in_order_with_their_values(tmp_path):
    rec = recorder(tmp_path / "flight")
    write(rec, 5)
    contents = read_ring(tmp_path / "flight" / CURRENT_RING)
    assert [r.seq for r in contents.records] == [0, 1, 2, 3, 4]
    assert [r.values for r in contents.records] == [node_values(i) for i in range(5)]
    assert [r.time for r in contents.records] == sorted(r.time for r in contents.records)
    assert contents.header.boot_id == "boot-a" and contents.corrupt == 0 and contents.problems == []
    assert (tmp_path / "flight").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "flight" / CURRENT_RING).stat().st_mode & 0o777 == 0o600


def test_a_restart_in_the_same_boot_continues_the_sequence(tmp_path):
    write(recorder(tmp_path), 3)
    again = recorder(tmp_path)
    write(again, 2, start=3)
    assert [r.seq for r in read_ring(tmp_path / CURRENT_RING).records] == [0, 1, 2, 3, 4]
    assert again.previous is None and not (tmp_path / PREVIOUS_RING).exists()


def _slot_offset(path: Path, seq: int) -> int:
    return read_ring(path).header.slot_offset(seq)


def test_a_truncated_record_is_skipped_with_one_log_line_and_then_overwritten(tmp_path, caplog):
    write(recorder(tmp_path), 4)
    path = tmp_path / CURRENT_RING
    offset = _slot_offset(path, 3)
    record = encode_record(3, 0.0, node_values(3))
    with open(path, "r+b") as f:  # the last record written only in part: its tail still zero
        f.seek(offset + len(record) // 2)
        f.write(bytes(len(record)))
    contents = read_ring(path)
    assert [r.seq for r in contents.records] == [0, 1, 2] and contents.corrupt == 1
    caplog.set_level(logging.INFO)
    again = recorder(tmp_path)
    write(again, 1, start=3)  # the next record takes the torn one's sequence number and slot
    assert sum("torn or corrupt" in r.getMessage() for r in caplog.records) == 1
    after = read_ring(path)
    assert [r.seq for r in after.records] == [0, 1, 2, 3] and after.corrupt == 0


def test_garbage_appended_or_written_into_slots_is_skipped(tmp_path):
    write(recorder(tmp_path), 3)
    path = tmp_path / CURRENT_RING
    header = read_ring(path).header
    with open(path, "r+b") as f:
        f.seek(header.slot_offset(5))  # an empty slot: garbage that starts like a record
        f.write(RECORD_MAGIC + os.urandom(200))
        f.seek(header.slot_offset(7))  # an empty slot: garbage that does not (remnants are not records)
        f.write(os.urandom(300).replace(RECORD_MAGIC, b"xxxx"))
        f.seek(0, os.SEEK_END)
        f.write(os.urandom(5000))  # appended past the ring
    contents = read_ring(path)
    assert [r.seq for r in contents.records] == [0, 1, 2]
    assert contents.corrupt == 1
    assert any("5000 bytes past the end" in p for p in contents.problems)


def test_a_record_in_the_wrong_slot_is_not_trusted(tmp_path):
    write(recorder(tmp_path), 2)
    path = tmp_path / CURRENT_RING
    header = read_ring(path).header
    with open(path, "r+b") as f:  # a valid record of seq 1 copied into slot 9: cannot be there
        f.seek(header.slot_offset(9))
        f.write(encode_record(1, 5.0, {"x": 1.0}))
    contents = read_ring(path)
    assert [(r.seq, r.values) for r in contents.records] == [(0, node_values(0)), (1, node_values(1))]
    assert contents.corrupt == 1


def test_hostile_slots_are_bounded():
    # a length far past the slot, and a valid checksum over a payload that inflates past the cap
    huge = struct.pack("<4sIQI", RECORD_MAGIC, 2**31, 0, 0)
    with pytest.raises(ValueError, match="runs past its slot"):
        decode_slot(huge + bytes(100))
    bomb = zlib.compress(b"0" * (MAX_PAYLOAD_JSON_BYTES + 10), 9)
    crc = zlib.crc32(bomb, zlib.crc32(struct.pack("<IQ", len(bomb), 0)))
    slot = struct.pack("<4sIQI", RECORD_MAGIC, len(bomb), 0, crc) + bomb
    with pytest.raises(ValueError, match="decompresses past"):
        decode_slot(slot)
    payload = zlib.compress(b'{"t": 1.0, "v": {"a": "not a number"}}')
    crc = zlib.crc32(payload, zlib.crc32(struct.pack("<IQ", len(payload), 0)))
    with pytest.raises(ValueError, match="not a mapping of series to numbers"):
        decode_slot(struct.pack("<4sIQI", RECORD_MAGIC, len(payload), 0, crc) + payload)


@pytest.mark.parametrize("change", [
    lambda b: b"NOTARING" + b[8:],
    lambda b: b[:30] + bytes([b[30] ^ 0xFF]) + b[31:],  # a flipped bit in the header's JSON
    lambda b: b[:100],
])
def test_a_ring_with_a_bad_header_is_moved_aside_and_recording_starts_again(tmp_path, caplog, change):
    write(recorder(tmp_path), 2)
    path = tmp_path / CURRENT_RING
    data = path.read_bytes()
    path.write_bytes(change(data[:HEADER_BYTES]) + data[HEADER_BYTES:])
    assert read_ring(path).header_damage is not None  # its records are recovered (test_flight_damaged_header.py)
    caplog.set_level(logging.INFO)
    again = recorder(tmp_path)
    write(again, 1)
    assert [r.seq for r in read_ring(path).records] == [0]
    (aside,) = tmp_path.glob(f"{CURRENT_RING}.corrupt-*")
    assert [r.seq for r in read_ring(aside).records] == [0, 1]
    assert sum("damaged header" in r.getMessage() for r in caplog.records) == 1


def test_a_file_that_is_no_ring_is_moved_aside(tmp_path, caplog):
    path = tmp_path / CURRENT_RING
    path.write_bytes(b"not a ring at all\n" * 1000)
    with pytest.raises(RingFormatError):
        read_ring(path)
    caplog.set_level(logging.INFO)
    write(recorder(tmp_path), 1)
    assert [r.seq for r in read_ring(path).records] == [0]
    assert len(list(tmp_path.glob(f"{CURRENT_RING}.corrupt-*"))) == 1
    assert sum("not a usable ring" in r.getMessage() for r in caplog.records) == 1


def test_header_geometry_is_bounded():
    with pytest.raises(RingFormatError):
        RingHeader(boot_id="b", slots=10**9, slot_bytes=4096, interval_seconds=1.0)
    with pytest.raises(RingFormatError):
        RingHeader(boot_id="b", slots=10, slot_bytes=5000, interval_seconds=1.0)


def test_a_new_boot_keeps_the_last_boot_apart(tmp_path):
    first = recorder(tmp_path, "boot-a")
    write(first, 4)
    last_a = read_ring(tmp_path / CURRENT_RING).records[-1]
    second = recorder(tmp_path, "boot-b")
    second.prepare()
    assert second.previous is not None
    assert (second.previous.boot_id, second.previous.records) == ("boot-a", 4)
    assert second.previous.last_record_time == last_a.time
    assert second.previous.min_headroom_bytes == min(node_values(i)[HEADROOM_SERIES] for i in range(4))
    write(second, 2)
    assert read_ring(tmp_path / PREVIOUS_RING).header.boot_id == "boot-a"
    current = read_ring(tmp_path / CURRENT_RING)
    assert current.header.boot_id == "boot-b" and [r.seq for r in current.records] == [0, 1]
    families = {s.name: s.value for m in second.collect() for s in m.samples}
    assert families["memtel_flight_previous_boot_last_record_timestamp_seconds"] == last_a.time
    assert families["memtel_flight_previous_boot_min_headroom_bytes"] == min(
        node_values(i)[HEADROOM_SERIES] for i in range(4))
    assert families["memtel_flight_recording"] == 1 and families["memtel_flight_records_written_total"] == 2
    third = recorder(tmp_path, "boot-c")
    third.prepare()
    assert third.previous is not None and third.previous.boot_id == "boot-b"  # boot-a's ring is gone now


@pytest.mark.slow
def test_the_ring_stays_within_its_bound_over_a_simulated_day(tmp_path):
    rec = recorder(tmp_path, duration_seconds=900, interval_seconds=1.0)
    path = tmp_path / CURRENT_RING
    sizes = set()
    values = {f"memtel_node_series_{i}": float(i) for i in range(40)}
    started = time.monotonic()
    for i in range(86_400):  # one record a second for a day, on a fast clock
        values[HEADROOM_SERIES] = float(i)
        assert rec.record(values)
        if i % 3_600 == 0:
            sizes.add(path.stat().st_size)
    elapsed = time.monotonic() - started
    contents = read_ring(path)
    assert len(sizes) == 1 and sizes.pop() == contents.header.file_bytes == HEADER_BYTES + 900 * 4096
    assert [r.seq for r in contents.records] == list(range(86_400 - 900, 86_400))
    assert [r.values[HEADROOM_SERIES] for r in contents.records] == [float(i) for i in range(86_400 - 900, 86_400)]
    assert contents.corrupt == 0
    assert elapsed < 120, f"a simulated day took {elapsed:.0f} s"


def test_a_record_larger_than_a_slot_grows_the_slots_and_keeps_the_records(tmp_path):
    rec = recorder(tmp_path)
    write(rec, 3)
    path = tmp_path / CURRENT_RING
    small = read_ring(path).header.slot_bytes
    big = {f"memtel_process_resident_bytes{{pid=\"{i}\",role=\"worker\"}}": float(os.urandom(4)[0] * i)
           for i in range(2_000)}
    assert len(encode_record(3, 0.0, big)) > small
    assert rec.record(big)
    contents = read_ring(path)
    assert contents.header.slot_bytes > small
    assert [r.seq for r in contents.records] == [0, 1, 2, 3] and contents.records[3].values == big
    assert path.stat().st_size == contents.header.file_bytes


def test_a_changed_duration_keeps_the_newest_records(tmp_path):
    write(recorder(tmp_path, duration_seconds=60), 50)
    shorter = recorder(tmp_path, duration_seconds=20)
    write(shorter, 1, start=50)
    contents = read_ring(tmp_path / CURRENT_RING)
    assert contents.header.slots == 20
    assert [r.seq for r in contents.records] == list(range(31, 51))


def test_a_symlink_planted_as_the_ring_is_never_followed(tmp_path):
    directory = tmp_path / "flight"
    directory.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"root-only data\n")
    (directory / CURRENT_RING).symlink_to(victim)
    write(recorder(directory), 2)
    assert victim.read_bytes() == b"root-only data\n"
    assert not (directory / CURRENT_RING).is_symlink()
    assert [r.seq for r in read_ring(directory / CURRENT_RING).records] == [0, 1]


def test_an_unsafe_directory_stops_recording_and_says_so_once(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    directory = tmp_path / "flight"
    directory.mkdir(mode=0o777)
    directory.chmod(0o777)  # writable by anyone: refused
    rec = recorder(directory, retry_seconds=0)
    for i in range(3):
        assert not rec.record(node_values(i))
    families = {s.name: s.value for m in rec.collect() for s in m.samples}
    assert families["memtel_flight_recording"] == 0 and families["memtel_flight_write_failures_total"] == 3
    assert sum("recording stopped" in r.getMessage() for r in caplog.records) == 1
    assert not (directory / CURRENT_RING).exists()
    directory.chmod(0o700)  # fixed: the next attempt records
    assert rec.record(node_values(3))
    assert any("recording again" in r.getMessage() for r in caplog.records)


# -- hook exporters ----------------------------------------------------------------------------------------
HOOK_TEXT = """# HELP memtel_allocator_reserved_bytes reserved
# TYPE memtel_allocator_reserved_bytes gauge
memtel_allocator_reserved_bytes{site="indexer",rank="0",node="n1"} 7.5e+09
# TYPE memtel_hook_host_mem_available_bytes gauge
memtel_hook_host_mem_available_bytes{rank="0"} 2.1e+10
# TYPE memtel_hook_reserved_delta_bytes histogram
memtel_hook_reserved_delta_bytes_bucket{le="+Inf",rank="0"} 4.0
memtel_hook_reserved_delta_bytes_count{rank="0"} 4.0
# TYPE memtel_hook_calls_total counter
memtel_hook_calls_total{rank="0"} 12.0
"""


def test_hook_series_keeps_allocator_and_host_memory_only():
    values = hook_series(HOOK_TEXT, "127.0.0.1:9200")
    assert values == {
        'memtel_allocator_reserved_bytes{node="n1",rank="0",site="indexer",target="127.0.0.1:9200"}': 7.5e9,
        'memtel_hook_host_mem_available_bytes{rank="0",target="127.0.0.1:9200"}': 2.1e10,
    }


def test_hook_scraper_reads_a_real_exporter_and_forgets_a_dead_one(caplog):
    caplog.set_level(logging.INFO)

    with static_exporter(HOOK_TEXT) as target:
        scraper = HookScraper((target,), timeout_seconds=2)
        scraper.scrape_once()
        assert len(scraper.latest()) == 2
    for _ in range(3):
        scraper.scrape_once()
    assert scraper.latest() == {}  # no stale values from a dead exporter
    assert sum("not readable" in r.getMessage() for r in caplog.records) == 1


# -- in the daemon: a fresh scrape is recorded, not collected twice ------------------------------------------
def test_a_fresh_scrape_is_recorded_instead_of_collecting_again(tmp_path):
    from prometheus_client.core import GaugeMetricFamily

    from telemetry.daemon.config import from_mapping
    from telemetry.daemon.flight import DaemonFlight
    from telemetry.daemon.registry import DaemonCollectors

    calls: list[float] = []

    class Counting:
        def collect(self):
            calls.append(time.monotonic())
            return [GaugeMetricFamily("memtel_test_collections", "Collections so far.", value=len(calls))]

    def run(scrape_every: float | None, state: Path) -> tuple[int, list]:
        calls.clear()
        config = from_mapping({"state_dir": str(state), "flight": {"interval_seconds": 0.2, "duration_seconds": 60}})
        wrapper = DaemonCollectors({"counting": Counting()})
        flight = DaemonFlight(config)
        flight.start(wrapper)
        scrapes = 0
        deadline = time.monotonic() + 30
        while flight.recorder.records_written < 8 and time.monotonic() < deadline:  # 8 records, however slow
            if scrape_every is not None:
                list(wrapper.collect())
                scrapes += 1
            time.sleep(scrape_every or 0.05)
        flight.stop()
        return scrapes, read_ring(state / "flight" / CURRENT_RING).records

    scrapes, records = run(0.05, tmp_path / "scraped")  # a scraper faster than the recorder
    assert len(records) >= 8
    assert len(calls) <= scrapes + 1  # the recorder collected at most once itself (before the first scrape)
    seen = [r.values["memtel_test_collections"] for r in records]
    assert seen == sorted(set(seen))  # each scrape recorded once at most, in order
    assert [r.time for r in records] == sorted({r.time for r in records})
    assert all(not key.startswith("memtel_flight_") for r in records for key in r.values)

    scrapes, records = run(None, tmp_path / "alone")  # nobody scrapes: the recorder collects itself
    assert scrapes == 0 and len(records) >= 8 and len(calls) == len(records)
