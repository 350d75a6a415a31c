from pathlib import Path

from telemetry.procfs.pressure import parse_pressure
from telemetry.procfs.vmstat import parse_vmstat

PROC = Path(__file__).parents[1] / "fixtures" / "proc"


def test_vmstat_real_fixture_has_the_counters_we_export():
    values = parse_vmstat((PROC / "vmstat.x86_64-debian12-24g").read_text())
    for field in ("pswpin", "pswpout", "oom_kill", "pgmajfault"):
        assert field in values and values[field] >= 0
    assert values["pgmajfault"] > 0  # a booted machine has had major faults
    assert len(values) > 100


def test_vmstat_fields_the_kernel_lacks_are_absent_and_bad_lines_skipped():
    values = parse_vmstat("pswpin 5\noom_kill x\nbroken\npgmajfault 7 extra\n")
    assert values == {"pswpin": 5}


def test_pressure_real_fixture_in_seconds():
    lines = parse_pressure((PROC / "pressure-memory.x86_64-debian12-24g").read_text())
    assert set(lines) == {"some", "full"}
    assert lines["some"].total_seconds >= lines["full"].total_seconds >= 0


def test_pressure_kernel_docs_example_converts_microseconds():
    # The example from the kernel's Documentation/accounting/psi.rst.
    text = ("some avg10=0.22 avg60=0.17 avg300=1.11 total=58761459\n"
            "full avg10=0.23 avg60=0.16 avg300=1.08 total=58464525\n")
    lines = parse_pressure(text)
    assert lines["some"].total_seconds == 58.761459
    assert lines["full"].total_seconds == 58.464525
    assert lines["some"].avg300 == 1.11


def test_pressure_without_full_line_leaves_it_absent():
    lines = parse_pressure("some avg10=0.00 avg60=0.00 avg300=0.00 total=12\n")
    assert set(lines) == {"some"}
