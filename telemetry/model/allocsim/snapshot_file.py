"""Read a memory snapshot file safely: JSON, or a pickle that can hold nothing but data.

Users hand memtel two kinds of files: `torch.cuda.memory_snapshot()` saved as JSON, and the pickle
`torch.cuda.memory._dump_snapshot()` writes (after `torch.cuda.memory._record_memory_history()`).
A pickle is a program: unpickling runs whatever callables it names. A snapshot is only dicts,
lists, tuples, strings, numbers, booleans and None, which pickle writes without naming any callable,
so the unpickler here refuses every global (`find_class`) and persistent id: a hostile pickle stops
with an error before anything in it runs. Either format may be gzip-compressed (`.gz`).

Limits: the file (and, for gzip, its decompressed content) may be at most `max_bytes`
(`DEFAULT_MAX_BYTES`, 2 GiB, unless the caller raises it); the size is checked before anything is
read, and only regular files are read (a FIFO or a device is refused). Nesting deeper than Python's
recursion limit is refused as corrupt.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import zlib
from pathlib import Path
from typing import Any

from telemetry.errors import ConfigError
from telemetry.safefs import FileTooLargeError, read_capped

DEFAULT_MAX_BYTES = 2 * 1024**3
GZIP_MAGIC = b"\x1f\x8b"
PICKLE_PROTO = 0x80  # the PROTO opcode that starts every pickle of protocol 2 or later


class SnapshotFileError(ConfigError):
    """A snapshot file that cannot be read as one (missing, too large, corrupt, not data-only)."""


class _DataOnlyUnpickler(pickle.Unpickler):
    """Builds builtin containers and scalars; any reference to a callable is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"it refers to the Python object {module}.{name}; a memory snapshot holds only dicts, lists, "
            "strings and numbers, so it is not loaded (a pickle that names objects can run code)")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent reference; a memory snapshot has none")


def loads_data_pickle(data: bytes) -> Any:
    """Unpickle `data` allowing only builtin data types; pickle.UnpicklingError otherwise."""
    return _DataOnlyUnpickler(io.BytesIO(data)).load()


def _gunzip(data: bytes, max_bytes: int, source: str) -> bytes:
    inflater = zlib.decompressobj(wbits=31)
    out = bytearray()
    try:
        chunk = inflater.decompress(data, max_bytes + 1)
        out += chunk
        while inflater.unconsumed_tail and len(out) <= max_bytes:
            out += inflater.decompress(inflater.unconsumed_tail, max_bytes + 1 - len(out))
    except zlib.error as exc:
        raise SnapshotFileError(f"{source}: not a readable gzip file ({exc})") from None
    if len(out) > max_bytes:
        raise SnapshotFileError(f"{source}: decompresses to more than {max_bytes:,} bytes (the limit; "
                                "raise it if the file is really this large)")
    if not inflater.eof:
        raise SnapshotFileError(f"{source}: the gzip stream is truncated")
    return bytes(out)


def parse_snapshot_bytes(data: bytes, source: str = "snapshot", max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """The document in `data`: JSON or a data-only pickle, either possibly gzip-compressed."""
    if data[:2] == GZIP_MAGIC:
        data = _gunzip(data, max_bytes, source)
    head = data.lstrip()[:1]
    if not head:
        raise SnapshotFileError(f"{source}: the file is empty; expected a memory snapshot (JSON or pickle)")
    if head in (b"{", b"["):
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SnapshotFileError(f"{source}: not valid JSON ({exc})") from None
        except RecursionError:
            raise SnapshotFileError(f"{source}: JSON nested too deeply to be a memory snapshot") from None
    if data[0] != PICKLE_PROTO:
        raise SnapshotFileError(f"{source}: neither JSON nor a pickle (it starts with {data[:8]!r}); expected "
                                "torch.cuda.memory_snapshot() as JSON or a torch.cuda.memory._dump_snapshot() pickle")
    try:
        return loads_data_pickle(data)
    except pickle.UnpicklingError as exc:
        if "refers to the Python object" in str(exc) or "persistent" in str(exc):
            raise SnapshotFileError(f"{source}: refused: {exc}") from None
        raise SnapshotFileError(f"{source}: a truncated or corrupt pickle ({exc})") from None
    except RecursionError:
        raise SnapshotFileError(f"{source}: a pickle nested too deeply to be a memory snapshot") from None
    except Exception as exc:  # a corrupt pickle can raise almost anything (EOFError, KeyError, ...)
        raise SnapshotFileError(f"{source}: a truncated or corrupt pickle ({type(exc).__name__}: {exc})") from None


def read_snapshot_file(path: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """Read and decode a snapshot file (JSON or data-only pickle, optionally gzip), within `max_bytes`."""
    source = str(path)
    if max_bytes < 1:
        raise SnapshotFileError(f"the size limit must be at least 1 byte, got {max_bytes}")
    try:
        data = read_capped(Path(path), max_bytes, follow_symlinks=True)
    except FileTooLargeError as exc:
        raise SnapshotFileError(f"{exc}; refused before reading (the limit is {max_bytes:,} bytes; "
                                "raise it with --max-file-gb if the file is really this large)") from None
    except OSError as exc:
        raise SnapshotFileError(f"{source}: cannot read: {exc.strerror or exc}") from None
    return parse_snapshot_bytes(data, source, max_bytes)


__all__ = ["DEFAULT_MAX_BYTES", "SnapshotFileError", "loads_data_pickle", "parse_snapshot_bytes",
           "read_snapshot_file"]
