"""Read a /proc file through one kept-open descriptor (pread from offset 0 regenerates its text).

Opening, reading and closing costs about three times a pread; the daemon reads these files on every
scrape. After an error the descriptor is dropped and the next read opens the file again.
"""

from __future__ import annotations

import os


class ProcFile:
    def __init__(self, path: str, size: int = 65536) -> None:
        self.path = path
        self.size = size
        self._fd: int | None = None

    def read_text(self) -> str:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(self._fd, self.size, 0).decode("ascii", "replace")
        except OSError:
            self.close()
            raise

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
