"""Files a root daemon or a serving process can write without being turned against the machine.

The daemon runs as root and the hook inside the serving process, so every path they write under is
attack surface: a directory another user created first, a symlink planted where a temporary file
will be opened, a disk that fills mid-write. The rules, used by every writer in memtel:

- a directory memtel writes in must be a real directory owned by the writing user and writable by
  nobody else, under parents that no other user can rename or replace (`ensure_private_dir`); memtel
  creates missing ones with mode 0700. A symbolic link is followed only if root or this user owns it
  (systemd's `StateDirectory=` with `DynamicUser=` is such a link);
- files are opened with `O_NOFOLLOW` (a symlink in the file's place is refused) and created 0600;
  new files with `O_EXCL` (`create_private`);
- a file that replaces another is written whole to a temporary file, checked (every byte written,
  size on disk), fsynced, renamed over the old one and the directory fsynced (`write_atomic`); on
  any failure the old file stays and the temporary file is removed;
- a file memtel reads back (its own state) is opened without following a symlink and read with a size
  cap (`read_capped`), so a planted 2 GB file or a FIFO cannot exhaust memory or hang the reader; a
  file that cannot be used is renamed aside for inspection (`move_aside`), never deleted.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import time
from pathlib import Path

from telemetry.errors import ConfigError

_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePathError(ConfigError):
    """A directory or file memtel was told to write is not safe to write (owner, mode, symlink)."""


def ensure_private_dir(path: str | os.PathLike[str], *, create: bool = True, what: str = "directory") -> Path:
    """`path` as a directory only this user can write; created 0700 if missing and `create`.

    Refuses (UnsafePathError) a non-directory, a directory owned by another user, one that group or
    others can write, a symbolic link that neither root nor this user owns, and a directory under a
    parent that another user could use to replace it (a parent owned by another user, or writable by
    group or others without the sticky bit, as /tmp has). A missing parent is created too (the
    nearest one with mode 0700).
    Returns the path as given (a trusted symbolic link is kept, not resolved).
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
    except OSError as exc:
        raise UnsafePathError(f"cannot use {what} {directory}: {exc.strerror}") from None
    euid = os.geteuid()
    real = directory
    if stat.S_ISLNK(info.st_mode):
        if info.st_uid not in (0, euid):
            raise UnsafePathError(f"{what} {directory} is a symbolic link owned by uid {info.st_uid}; expected a "
                                  "real directory (or a link owned by root or this user)")
        try:
            real = directory.resolve(strict=True)
            info = os.stat(real)
        except (OSError, RuntimeError) as exc:
            raise UnsafePathError(f"{what} {directory} is a symbolic link that does not resolve: {exc}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafePathError(f"{what} {directory} is not a directory")
    if info.st_uid != euid:
        raise UnsafePathError(f"{what} {directory} is owned by uid {info.st_uid}, not by this user "
                              f"(uid {euid}); expected a directory of this user's that no one else can write")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafePathError(f"{what} {directory} is writable by group or others (mode "
                              f"{stat.S_IMODE(info.st_mode):04o}); expected 0700 or 0755")
    _check_parents(Path(os.path.realpath(real)), directory, what)
    return directory


def _check_parents(real: Path, given: Path, what: str) -> None:
    """Every parent of `real` must be safe from other users: owned by root or this user, and not
    writable by group or others unless sticky (then only an entry's owner can rename it)."""
    euid = os.geteuid()
    for parent in real.parents:
        try:
            info = os.stat(parent)
        except OSError as exc:
            raise UnsafePathError(f"cannot check the parent {parent} of {what} {given}: {exc.strerror}") from None
        if info.st_uid not in (0, euid):
            raise UnsafePathError(f"{what} {given}: its parent {parent} is owned by uid {info.st_uid}, who could "
                                  "replace it; expected parents owned by root or this user")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
            raise UnsafePathError(f"{what} {given}: its parent {parent} is writable by group or others without the "
                                  f"sticky bit (mode {stat.S_IMODE(info.st_mode):04o}), so another user could replace "
                                  "it; choose a directory under a safe parent")


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


class FileTooLargeError(OSError):
    """A file is larger than the caller's cap (it was not read)."""


def read_capped(path: str | os.PathLike[str], max_bytes: int, *, follow_symlinks: bool = False) -> bytes:
    """The whole content of the regular file `path`, refusing more than `max_bytes`.

    Opened with O_NONBLOCK (a FIFO does not block) and, unless `follow_symlinks` (for a config file the
    administrator named), O_NOFOLLOW; checked to be a regular file; at most `max_bytes + 1` bytes are
    read, so a file that grows while it is read is refused too. Raises FileNotFoundError,
    FileTooLargeError or another OSError.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(path, flags) if follow_symlinks else open_private(path, flags)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a regular file")
        if info.st_size > max_bytes:
            raise FileTooLargeError(f"{path} is {info.st_size} bytes, more than the {max_bytes} expected")
        chunks: list[bytes] = []
        total = 0
        while total <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > max_bytes:
            raise FileTooLargeError(f"{path} grew past {max_bytes} bytes while it was read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def move_aside(path: str | os.PathLike[str], tag: str = "corrupt", keep: int = 5) -> Path:
    """Rename `path` to `NAME.<tag>-<UTC time, to the microsecond>` beside it (for inspection); return it.

    Only the `keep` newest such copies are kept, so a file that keeps going bad cannot fill the disk.
    Raises OSError when the rename fails.
    """
    source = Path(path)
    while True:  # microseconds in the name: names sort by age, and two moves never collide
        now = time.time()
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now * 1e6) % 1_000_000:06d}Z"
        aside = source.with_name(f"{source.name}.{tag}-{stamp}")
        if not os.path.lexists(aside):
            break
        time.sleep(1e-6)
    os.replace(source, aside)
    olders = sorted(source.parent.glob(f"{source.name}.{tag}-*"), key=lambda p: p.name, reverse=True)
    for older in olders[keep:]:
        with contextlib.suppress(OSError):
            os.unlink(older)
    return aside


def remove_stale_temporaries(path: str | os.PathLike[str]) -> int:
    """Remove `write_atomic`'s leftover temporaries of `path` (after a kill mid-save); returns how many."""
    target = Path(path)
    removed = 0
    for leftover in target.parent.glob(f".{target.name}.*.tmp"):
        with contextlib.suppress(OSError):
            os.unlink(leftover)  # unlink removes a symlink itself, never its target
            removed += 1
    return removed


__all__ = ["FileTooLargeError", "UnsafePathError", "create_private", "ensure_private_dir", "fsync_dir", "move_aside",
           "open_private", "read_capped", "remove_stale_temporaries", "temporary_name", "write_all", "write_atomic"]
