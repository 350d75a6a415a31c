"""Files a root daemon or a serving process can write without being turned against the machine.

The daemon runs as root and the hook inside the serving process, so every path they write under is
attack surface: a directory another user created first, a symlink planted where a temporary file
will be opened, a disk that fills mid-write. The rules, used by every writer in memtel:

- a directory memtel writes in must be a real directory (not a symlink), owned by the writing user
  and writable by nobody else (`ensure_private_dir`); memtel creates missing ones with mode 0700;
- files are opened with `O_NOFOLLOW` (a symlink in the file's place is refused) and created 0600;
  new files with `O_EXCL` (`create_private`);
- a file that replaces another is written whole to a temporary file, checked (every byte written,
  size on disk), fsynced, renamed over the old one and the directory fsynced (`write_atomic`); on
  any failure the old file stays and the temporary file is removed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from telemetry.errors import ConfigError

_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePathError(ConfigError):
    """A directory or file memtel was told to write is not safe to write (owner, mode, symlink)."""


def ensure_private_dir(path: str | os.PathLike[str], *, create: bool = True, what: str = "directory") -> Path:
    """`path` as a directory only this user can write; created 0700 if missing and `create`.

    Refuses (UnsafePathError) a symlink, a non-directory, a directory owned by another user, or one
    that group or others can write. Parent directories are not created by this call beyond the last
    component's parents, which are made with mode 0700 too.
    """
    directory = Path(path)
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        if not create:
            raise UnsafePathError(f"{what} {directory} does not exist") from None
        try:
            directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass  # created by someone else meanwhile: checked below like any existing one
        except OSError as exc:
            raise UnsafePathError(f"cannot create {what} {directory}: {exc.strerror}") from None
        info = os.lstat(directory)
    if stat.S_ISLNK(info.st_mode):
        raise UnsafePathError(f"{what} {directory} is a symbolic link; expected a real directory")
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafePathError(f"{what} {directory} is not a directory")
    if info.st_uid != os.geteuid():
        raise UnsafePathError(f"{what} {directory} is owned by uid {info.st_uid}, not by this user "
                              f"(uid {os.geteuid()}); expected a directory of this user's that no one else can write")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafePathError(f"{what} {directory} is writable by group or others (mode "
                              f"{stat.S_IMODE(info.st_mode):04o}); expected 0700 or 0755")
    return directory


def open_private(path: str | os.PathLike[str], flags: int, mode: int = 0o600) -> int:
    """`os.open` that never follows a symlink in the last component; new files get `mode` (0600)."""
    return os.open(path, flags | _OPEN_FLAGS, mode)


def create_private(path: str | os.PathLike[str], flags: int = os.O_WRONLY, mode: int = 0o600) -> int:
    """Create a new file (O_EXCL: an existing file or symlink in its place is an error)."""
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, mode)


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of `data` or raise OSError (a short write is retried, not ignored)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(f"write returned {written} with {len(view)} bytes left")
        view = view[written:]


def temporary_name(path: Path) -> Path:
    """The temporary file `write_atomic` uses beside `path` (`.NAME.<random>.tmp`)."""
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")


def write_atomic(path: str | os.PathLike[str], data: bytes, mode: int = 0o600) -> None:
    """Replace `path` with `data`: written whole, size checked, fsynced, renamed, directory fsynced.

    On any failure the previous file is untouched, the temporary file is removed and OSError raised.
    """
    target = Path(path)
    tmp = temporary_name(target)
    fd = create_private(tmp, os.O_WRONLY, mode)
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
            size = os.fstat(fd).st_size
            if size != len(data):
                raise OSError(f"{tmp}: {size} bytes on disk after writing {len(data)}")
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(target.parent)


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename or a new file in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temporaries(path: str | os.PathLike[str]) -> int:
    """Remove `write_atomic`'s leftover temporaries of `path` (after a kill mid-save); returns how many."""
    target = Path(path)
    removed = 0
    for leftover in target.parent.glob(f".{target.name}.*.tmp"):
        with contextlib.suppress(OSError):
            os.unlink(leftover)  # unlink removes a symlink itself, never its target
            removed += 1
    return removed


__all__ = ["UnsafePathError", "create_private", "ensure_private_dir", "fsync_dir", "open_private",
           "remove_stale_temporaries", "temporary_name", "write_all", "write_atomic"]
