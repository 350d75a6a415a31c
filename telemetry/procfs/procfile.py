"""Read a /proc file through one kept-open descriptor (pread from offset 0 regenerates its text).

Opening, reading and closing costs about three times a pread; the hook reads /proc/meminfo after
every hooked call and the daemon reads its files on every scrape. The descriptor belongs to the
process that opened it: a forked child opens its own. After an error it is dropped and the next
read opens the file again.
"""

from __future__ import annotations

import os


class ProcFile:
    def __init__(self, path: str, size: int = 65536) -> None:
        self.path = path
        self.size = size
        self._fd: int | None = None
        self._pid = -1

    def read_text(self) -> str:
        if self._fd is None or self._pid != os.getpid():
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            self._pid = os.getpid()
        try:
            return os.pread(self._fd, self.size, 0).decode("ascii", "replace")
        except OSError:
            self.close()
            raise

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
