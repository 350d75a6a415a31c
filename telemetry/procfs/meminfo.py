"""/proc/meminfo: a pure parser and a reader that keeps its file descriptor open.

Values are returned in bytes. Fields the kernel does not print are absent from the
mapping, never zero. Lines without a unit (HugePages_Total, HugePages_Free, ...) are
counts and are returned as they are.
"""

from __future__ import annotations

from collections.abc import Callable

from telemetry.procfs.procfile import ProcFile

_read_fields_compiled: Callable[[int], tuple[int | None, int | None]] | None
try:  # the compiled fast path (setup.py); absent where the install had no C compiler
    from telemetry.procfs._meminfo_speedups import read_available_and_swap_free as _read_fields_compiled
except ImportError:
    _read_fields_compiled = None

MEMINFO_PATH = "/proc/meminfo"


def parse_meminfo(text: str) -> dict[str, int]:
    """Parse meminfo text into {field: value}; `kB` values become bytes."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        if not sep:
            continue
        parts = rest.split()
        if not parts:
            continue
        try:
            number = int(parts[0])
        except ValueError:
            continue
        if len(parts) > 1 and parts[1] == "kB":
            number *= 1024
        values[name.strip()] = number
    return values


def parse_available_and_swap_free(data: bytes) -> tuple[int | None, int | None]:
    """MemAvailable and SwapFree in bytes from the raw file, found with `bytes.find` (None when absent).

    The hook needs just these two lines after every call: finding them in the undecoded bytes
    costs about a tenth of decoding and splitting all ~55 lines. The compiled fast path
    (_meminfo_speedups.c) gives the same answers; the tests hold the two together.
    """
    return _kb_field(data, b"MemAvailable:"), _kb_field(data, b"SwapFree:")


def _kb_field(data: bytes, label: bytes) -> int | None:
    """The value of the line that starts with `label` (labels open lines, as the compiled path reads them)."""
    if data.startswith(label):
        start = 0
    else:
        start = data.find(b"\n" + label) + 1
        if start == 0:
            return None
    end = data.find(b"kB", start)
    if end < 0:
        raise ValueError(f"/proc/meminfo: {label.decode()} is not followed by a number of kB")
    return int(data[start + len(label):end]) << 10


class MeminfoReader(ProcFile):
    """/proc/meminfo through a kept-open descriptor: the hook reads it after every hooked call."""

    def __init__(self, path: str = MEMINFO_PATH, compiled: bool = True) -> None:
        super().__init__(path, size=16384)
        # The compiled read-and-parse when built (about a third of the pure-Python cost on top of
        # the read itself, see BENCHMARKS.md); `compiled=False` forces the Python path (tests).
        self.compiled = compiled and _read_fields_compiled is not None

    def read(self) -> dict[str, int]:
        return parse_meminfo(self.read_text())

    def available_and_swap_free(self) -> tuple[int | None, int | None]:
        """MemAvailable and SwapFree in bytes, None where absent (see parse_available_and_swap_free)."""
        if not self.compiled:
            return parse_available_and_swap_free(self.read_bytes())
        fd = self._fd
        if fd is None:
            fd = self.fileno()
        try:
            return _read_fields_compiled(fd)  # type: ignore[misc]  # not None: self.compiled says so
        except OSError:
            self.close()
            raise
