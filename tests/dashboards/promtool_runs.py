"""`promtool test rules` over many unit-test files at once, each file's outcome kept apart.

One promtool process tests its files one after the other and prints, per file, `Unit Testing:  FILE`
followed by `SUCCESS` or `FAILED:` and the failures (on stderr, the rest on stdout). Both streams go to one
pipe here, so the order is kept and the output splits back into one section per file. The files are shared
out over as many processes as there are CPUs (the heaviest first, by size), which run at the same time.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

_HEADER = re.compile(r"^Unit Testing:\s+(\S.*?)\s*$", re.MULTILINE)
TIMEOUT_S = 300


@dataclass(frozen=True)
class FileOutcome:
    path: Path
    passed: bool
    output: str  # promtool's section for this file: its header, SUCCESS or FAILED and the failures


def promtool_binary() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: install Debian's prometheus package (scripts/test does it: "
                    "`source scripts/lib/setup.sh && ensure_system_packages`, as root)")
    return path


def _share_out(files: list[Path], processes: int) -> list[list[Path]]:
    """Longest first onto the least loaded process (file size stands in for the work in it)."""
    shares: list[list[Path]] = [[] for _ in range(max(1, min(processes, len(files))))]
    loads = [0] * len(shares)
    for path in sorted(files, key=lambda p: p.stat().st_size, reverse=True):
        i = loads.index(min(loads))
        shares[i].append(path)
        loads[i] += path.stat().st_size
    return shares


def _run(files: list[Path]) -> dict[Path, FileOutcome]:
    result = subprocess.run([promtool_binary(), "test", "rules", *map(str, files)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
    text = result.stdout
    headers = list(_HEADER.finditer(text))
    outcomes: dict[Path, FileOutcome] = {}
    for n, header in enumerate(headers):
        section = text[header.start():headers[n + 1].start() if n + 1 < len(headers) else len(text)]
        path = Path(header.group(1))
        body = section[header.end() - header.start():]
        passed = re.search(r"^\s*SUCCESS\s*$", body, re.MULTILINE) is not None and "FAILED" not in body
        outcomes[path] = FileOutcome(path, passed, section)
    missing = [p for p in files if p not in outcomes]
    if missing or (result.returncode == 0) != all(o.passed for o in outcomes.values()):
        raise AssertionError(f"promtool's output does not match its files {missing or ''} "
                             f"(exit {result.returncode}):\n{text[-3000:]}")
    return outcomes


def run_unit_tests(files: list[Path], processes: int | None = None) -> dict[Path, FileOutcome]:
    """Each file's outcome (keyed by the path as given, which must be absolute)."""
    assert all(p.is_absolute() for p in files), files
    shares = _share_out(files, processes or os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=len(shares)) as pool:
        outcomes: dict[Path, FileOutcome] = {}
        for part in pool.map(_run, shares):
            outcomes.update(part)
    return outcomes

