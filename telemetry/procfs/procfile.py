"""Read a /proc file through one kept-open descriptor (pread from offset 0 regenerates its text).

Opening, reading and closing costs about three times a pread; the hook reads /proc/meminfo after
every hooked call and the daemon reads its files on every scrape. The descriptor belongs to the
process that opened it: a forked child closes its inherited copy (an at-fork handler, not a
getpid() per read: that is a system call) and opens its own on its first read. After an error
the descriptor is dropped and the next read opens the file again.
"""

from __future__ import annotations

import os
import weakref

_open_files: weakref.WeakSet[ProcFile] = weakref.WeakSet()


class ProcFile:
    def __init__(self, path: str, size: int = 65536) -> None:
        self.path = path
        self.size = size
        self._fd: int | None = None

    def fileno(self) -> int:
        """The kept descriptor, opened on first use."""
        fd = self._fd
        if fd is None:
            fd = self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            _open_files.add(self)
        return fd

    def read_bytes(self) -> bytes:
        fd = self._fd
        if fd is None:
            fd = self.fileno()
        try:
            return os.pread(fd, self.size, 0)
        except OSError:
            self.close()
            raise

    def read_text(self) -> str:
        return self.read_bytes().decode("ascii", "replace")

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            _open_files.discard(self)
            os.close(fd)


def _close_inherited() -> None:
    for proc_file in list(_open_files):
        try:
            proc_file.close()
        except OSError:
            pass


os.register_at_fork(after_in_child=_close_inherited)
