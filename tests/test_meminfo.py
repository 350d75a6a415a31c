from pathlib import Path

from telemetry.procfs.meminfo import MeminfoReader, parse_meminfo

FIXTURES = Path(__file__).parent / "fixtures" / "proc"


def test_parse_real_fixture_in_bytes():
    values = parse_meminfo((FIXTURES / "meminfo.x86_64-debian12-24g").read_text())
    assert values["MemTotal"] % 1024 == 0 and values["MemTotal"] > 20 * 2**30
    assert 0 < values["MemAvailable"] <= values["MemTotal"]
    assert values["HugePages_Total"] == 0  # a count, not scaled by 1024


def test_missing_fields_are_absent_not_zero():
    values = parse_meminfo("MemTotal:  100 kB\nbogus line\nMemFree: x kB\n")
    assert values == {"MemTotal": 102400}


def test_kept_fd_reader_matches_fresh_read():
    reader = MeminfoReader()
    available, swap_free = reader.available_and_swap_free()
    fresh = parse_meminfo(Path("/proc/meminfo").read_text())
    assert abs(available - fresh["MemAvailable"]) <= 0.05 * fresh["MemAvailable"]
    assert swap_free == fresh["SwapFree"]
    reader.close()
