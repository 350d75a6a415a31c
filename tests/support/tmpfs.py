"""Small real file systems for tests: a tmpfs of a few pages, and a way to fill it to the last byte.

A full disk is not mocked: the daemon's state and the hook's log are tested on a tmpfs mounted for
the test (root only; skipped with the reason elsewhere), filled with a real file.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


class SmallTmpfs:
    """A tmpfs of `size` bytes mounted at `path` for one test (root only: skipped, with the reason, elsewhere)."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size

    def __enter__(self) -> Path:
        if os.geteuid() != 0:
            pytest.skip("needs root to mount a small tmpfs (a nearly full disk, for real)")
        self.path.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size},mode=0700", "tmpfs",
                                 str(self.path)], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip() or result.returncode}")
        return self.path

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


def fill(directory: Path, leave_bytes: int = 0, name: str = "filler") -> Path:
    """Fill the file system of `directory` to the last byte, then give back `leave_bytes` (page-rounded)."""
    filler = directory / name
    chunk = b"\0" * 65536
    with open(filler, "wb", buffering=0) as f:
        while True:
            try:
                written = f.write(chunk)
            except OSError:
                break
            if not written:
                break
        for size in (4096, 512, 1):  # the last partial pages
            while True:
                try:
                    f.write(b"\0" * size)
                except OSError:
                    break
    if leave_bytes:
        os.truncate(filler, max(0, filler.stat().st_size - leave_bytes))
    return filler
