"""Building the native snapshot reader (snapshot_native.cpp) once per torch, and finding the build.

`python -I -c ...build.main() DIR` (started by reader.py in the background, never waited for by the serving
process; isolated and run in DIR, so nothing in the engine's working directory is imported: reader.build_command)
compiles the extension with `torch.utils.cpp_extension.load(..., with_cuda=True)` into DIR, at a low
CPU priority, one build at a time per DIR (a lock file: several ranks starting together build once). It needs
what a torch extension needs: a C++ compiler, ninja, the CUDA headers of torch's CUDA (CUDA_HOME), and a torch
with its headers (a CUDA wheel has them). A failed build writes `failed.txt` with the reason; no process tries
that DIR again (delete the DIR to retry).

DIR is `<cache>/memtel/snapshot_native/<key>`: <cache> is `$XDG_CACHE_HOME` or `~/.cache`; <key> a hash of the
source, the format, the torch (version, git commit, CUDA version), the Python and the machine, so a build is
never loaded into another torch (the extension reads torch's C++ structures: their layout is that torch's).
The serving process loads only a file it owns in folders it owns that nobody else can write (`trusted_file`):
another user's planted library never runs inside it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import stat
import sys
from pathlib import Path
from typing import Any

from telemetry.hook.forecast.snapshot_native.codec import FORMAT_VERSION

SOURCE = Path(__file__).with_name("snapshot_native.cpp")
NAME = "memtel_snapshot_native"
FAILED = "failed.txt"
LOCK = "build.lock"
LOG = "build.log"


def cache_root(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME", "").strip()
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"
    return root / "memtel" / "snapshot_native"


def build_key(torch: Any) -> str:
    """What a build depends on, hashed: a build is loaded only into the torch and Python it was made for."""
    version = getattr(torch, "version", None)
    parts = [SOURCE.read_bytes(), str(FORMAT_VERSION).encode(), str(getattr(torch, "__version__", "?")).encode(),
             str(getattr(version, "git_version", "?")).encode(), str(getattr(version, "cuda", None)).encode(),
             sys.version.encode(), platform.machine().encode()]
    digest = hashlib.sha256(b"\0".join(parts)).hexdigest()
    return digest[:20]


def module_name(key: str) -> str:
    return f"{NAME}_{key}"


def build_directory(torch: Any, environ: dict[str, str] | None = None) -> Path:
    return cache_root(environ) / build_key(torch)


def library_path(directory: Path) -> Path:
    return directory / f"{module_name(directory.name)}.so"


def private_directory(path: Path) -> None:
    """Make `path` (and the folders down to it from the cache root's parent) as this user's, 0700; raise
    OSError where one exists and is not this user's private folder (a link, another owner, writable by others)."""
    for folder in (path.parent.parent, path.parent, path):
        folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)
        trusted(folder, directory=True)


def trusted(path: Path, *, directory: bool = False) -> None:
    """OSError unless `path` is this user's own (not a symbolic link, not writable by group or others)."""
    info = os.lstat(path)
    kind_ok = stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)
    if not kind_ok:
        raise OSError(f"{path} is not a plain {'folder' if directory else 'file'} (a link?)")
    if info.st_uid != os.geteuid():
        raise OSError(f"{path} belongs to uid {info.st_uid}, not this process's {os.geteuid()}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise OSError(f"{path} is writable by others (mode {stat.S_IMODE(info.st_mode):o})")


def trusted_file(directory: Path) -> Path:
    """The built library in `directory`, checked as `trusted` with its folders; OSError if missing or not."""
    library = library_path(directory)
    for folder in (directory, directory.parent, directory.parent.parent):
        trusted(folder, directory=True)
    trusted(library)
    return library


def failure(directory: Path) -> str | None:
    """Why the build in `directory` failed, if it did (its `failed.txt`, first line)."""
    try:
        with open(directory / FAILED, encoding="utf-8", errors="replace") as file:
            lines = file.read(400).strip().splitlines()
    except OSError:
        return None
    return lines[0] if lines else "failed (no reason written)"


def build(directory: Path) -> Path:
    """Compile the extension into `directory` (this process imports torch); the library's path. Raises what the
    build raises (a missing compiler, headers, CUDA_HOME: torch's messages)."""
    import shutil

    from torch.utils.cpp_extension import load

    source = directory / SOURCE.name
    shutil.copyfile(SOURCE, source)
    load(name=module_name(directory.name), sources=[str(source)], build_directory=str(directory), with_cuda=True,
         extra_cflags=["-O2"], verbose=False)
    return library_path(directory)


def main(argv: list[str] | None = None) -> int:
    """The background build: `DIR`; exit 0 when the library is there (built now or before), 1 when not."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: build.py DIR (the cache folder of this torch's build)", file=sys.stderr)
        return 2
    directory = Path(args[0])
    with contextlib.suppress(OSError):
        os.nice(10)   # the build competes with serving for the CPU: it gives way
    try:
        private_directory(directory)
        lock = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as error:
        print(f"memtel: cannot use {directory}: {error}", file=sys.stderr)
        return 1
    with os.fdopen(lock, "r+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)   # another rank's build: wait for it, then use its library
        if failure(directory) is not None:
            return 1
        with contextlib.suppress(OSError):
            trusted_file(directory)
            return 0
        try:
            build(directory)
            trusted_file(directory)
        except BaseException as error:   # any failure is written down once, for every process
            reason = " ".join(f"{type(error).__name__}: {error}".split())[:300]
            with contextlib.suppress(OSError):
                (directory / FAILED).write_text(reason + "\n", encoding="utf-8")
            print(f"memtel: the native snapshot reader did not build: {reason}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["build", "build_directory", "build_key", "cache_root", "failure", "main", "trusted_file"]
