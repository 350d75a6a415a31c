"""Golden end-to-end output of the hook's exporter: real hooked calls, /metrics over HTTP, compared with a
checked-in file (catches a renamed or dropped series that dashboards and alerts rely on), then linted with
promtool.

The inputs are fixed: a fixed allocator source (a sequence that grows, reuses and frees, with one unreadable
read), /proc/meminfo from a fixture file, a fixed node name, rank 0. Only the process's own figures are masked:
its pid and resident set (the engine series: a process that gives the hook its allocator is an engine).
Regenerate after an intended change: MEMTEL_UPDATE_GOLDEN=1 pytest tests/hook/test_golden_metrics.py
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

import telemetry
from telemetry.allocator_counters import AllocatorCounters
from telemetry.hook import set_allocator_source
from tests.support.ports import free_port

FIXTURES = Path(__file__).parents[1] / "fixtures"
GOLDEN = FIXTURES / "hook" / "metrics.golden-sequence__meminfo.x86_64-debian12-24g.prom"
MiB = 1 << 20

KERNELS = """
def logits_chunk(rows, cols):
    return rows * cols

def release(handle):
    return None
"""

# (reserved, allocated, num_device_alloc, num_device_free, retries, ooms) per read; None: unreadable.
SEQUENCE: list[tuple[int, int, int, int, int, int] | str] = [
    (20 * MiB, 8 * MiB, 1, 0, 0, 0),      # the baseline at install
    (20 * MiB, 12 * MiB, 1, 0, 0, 0),     # logits_chunk: fits the segment
    (42 * MiB, 30 * MiB, 2, 0, 0, 0),     # logits_chunk: a new segment (growth, +22 MiB)
    (42 * MiB, 14 * MiB, 2, 0, 0, 0),     # release
    "unreadable",                         # logits_chunk: the source fails (counted, not raised)
    (106 * MiB, 80 * MiB, 3, 0, 1, 0),    # logits_chunk: a retry and a new segment (+64 MiB)
    (64 * MiB, 40 * MiB, 3, 1, 1, 0),     # release after empty_cache (a decrease counts as 0)
    (64 * MiB, 40 * MiB, 3, 1, 1, 0),     # logits_chunk: nothing changed
]


@pytest.fixture
def golden_exporter(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "memtel_golden_kernels.py").write_text(KERNELS)
    kernels = importlib.import_module("memtel_golden_kernels")
    reads = iter(SEQUENCE)

    def source():
        values = next(reads)
        if isinstance(values, str):
            raise RuntimeError(f"allocator statistics {values}")
        return AllocatorCounters(*values)

    set_allocator_source(source, device="sim:0")
    port = free_port()
    handle = telemetry.install(["memtel_golden_kernels:logits_chunk", "memtel_golden_kernels:release",
                                "memtel_golden_missing.kernels:logits"],
                               port=port, addr="127.0.0.1", log_dir=tmp_path / "logs", node="golden-node",
                               meminfo_path=str(FIXTURES / "proc" / "meminfo.x86_64-debian12-24g"),
                               unresolved_after_s=None)
    kernels.logits_chunk(4, 1024)
    kernels.logits_chunk(4, 2048)
    kernels.release(1)
    kernels.logits_chunk(4, 4096)
    kernels.logits_chunk(4, 8192)
    kernels.release(2)
    kernels.logits_chunk(4, 8192)
    handle.check_unresolved()
    handle.flush()
    try:
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        handle.uninstall()
        kernels_name = kernels.__name__
        import sys

        sys.modules.pop(kernels_name, None)


def masked(text: str) -> str:
    """The process's pid and resident set, which differ from run to run, as PID and RSS."""
    text = re.sub(r'pid="\d+"', 'pid="PID"', text)
    return re.sub(r"^(memtel_engine_resident_bytes\{[^}]*\}) \S+$", r"\1 RSS", text, flags=re.MULTILINE)


def test_hook_metrics_match_the_golden_file(golden_exporter):
    text = masked(httpx.get(golden_exporter, timeout=5).text)
    if os.environ.get("MEMTEL_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


@pytest.mark.prometheus
def test_promtool_finds_no_problems_in_the_hook_metrics(golden_exporter):
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: apt-get install -y prometheus (scripts/test does it)"
    text = httpx.get(golden_exporter, timeout=5).text
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    problems = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert problems == []
