"""Read a memory snapshot file safely: JSON, or a pickle that can hold nothing but data.

Users hand memtel two kinds of files: `torch.cuda.memory_snapshot()` saved as JSON, and the pickle
`torch.cuda.memory._dump_snapshot()` writes (after `torch.cuda.memory._record_memory_history()`).
A pickle is a program: unpickling runs whatever callables it names. A snapshot is only dicts,
lists, tuples, strings, numbers, booleans and None, which pickle writes without naming any callable,
so the unpickler here refuses every global (`find_class`) and persistent id: a hostile pickle stops
with an error before anything in it runs. Either format may be gzip-compressed (`.gz`).

Limits (telemetry/limits.py; each error names the limit and the flag that raises it):
- the file, and its content once decompressed, at most `max_bytes` (`--max-file-gb`); the file's
  size is checked before anything is read, only regular files are read (not a FIFO or a device);
- a gzip file is decompressed as the parser reads it (never whole in memory for a pickle);
- at most `max_objects` containers (dicts, lists, tuples) built while unpickling or parsing JSON
  (`--max-objects`): a small pickle can name millions of small dicts, each 100 times its bytes;
  the readers then cap segments and blocks (`--max-blocks`, snapshot.py) and trace entries
  (`--max-objects`, trace.py), counting shared references each time they are read;
- one string or pickle frame at most MAX_SNAPSHOT_VALUE_BYTES, a JSON text at most
  MAX_SNAPSHOT_JSON_BYTES (parsed whole); integers of more than 4,300 digits are refused as corrupt;
- nesting deeper than Python's recursion limit is refused as corrupt.
"""

from __future__ import annotations

import gc
import io
import json
import os
import pickle
import zlib
from pathlib import Path
from typing import Any

from telemetry.errors import ConfigError, printable, shown
from telemetry.limits import (
    MAX_SNAPSHOT_FILE_BYTES,
    MAX_SNAPSHOT_JSON_BYTES,
    MAX_SNAPSHOT_OBJECTS,
    MAX_SNAPSHOT_VALUE_BYTES,
)
from telemetry.safefs import FileTooLargeError, read_capped

DEFAULT_MAX_BYTES = MAX_SNAPSHOT_FILE_BYTES
DEFAULT_MAX_OBJECTS = MAX_SNAPSHOT_OBJECTS
GZIP_MAGIC = b"\x1f\x8b"
PICKLE_PROTO = 0x80  # the PROTO opcode that starts every pickle of protocol 2 or later
CHUNK = 256 * 1024


class SnapshotFileError(ConfigError):
    """A snapshot file that cannot be read as one (missing, too large, corrupt, not data-only)."""


def objects_limit_error(source: str, limit: int, what: str = "objects",
                        flag: str = "--max-objects") -> SnapshotFileError:
    return SnapshotFileError(f"{source}: holds more than {limit:,} {what} (the limit; raise it with {flag} "
                             "if the file is really this large)")


class _DataOnlyUnpickler(pickle.Unpickler):
    """Builds builtin containers and scalars; any reference to a callable is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"it refers to the Python object {module}.{name}; a memory snapshot holds only dicts, lists, "
            "strings and numbers, so it is not loaded (a pickle that names objects can run code)")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent reference; a memory snapshot has none")


class _Limit(Exception):
    """Raised inside the parser when a limit is reached; carries the one-line error."""

    def __init__(self, error: SnapshotFileError) -> None:
        super().__init__(str(error))
        self.error = error


class _Stream(io.RawIOBase):
    """The file's content as the parser reads it: gunzipped on the way, within the byte and object limits.

    The C unpickler reads through here in blocks (a frame, or its read-ahead), so the checks run every
    few hundred kilobytes of input, never per object. Containers are counted with the garbage collector's
    allocation count (collection is off while parsing), which every dict, list and tuple increments.
    """

    def __init__(self, data: bytes, source: str, max_bytes: int, max_objects: int) -> None:
        super().__init__()
        self._data = memoryview(data)
        self._pos = 0
        self._inflater = zlib.decompressobj(wbits=31) if data[:2] == GZIP_MAGIC else None
        self._pending = b""
        self.source = source
        self.max_bytes = max_bytes
        self.max_objects = max_objects
        self.produced = 0
        self._objects_at_start = gc.get_count()[0]

    def readable(self) -> bool:
        return True

    def check_objects(self) -> None:
        if gc.get_count()[0] - self._objects_at_start > self.max_objects:
            raise _Limit(objects_limit_error(self.source, self.max_objects))

    def _more(self, want: int) -> bytes:
        """Up to `want` more bytes of content (b"" at its end)."""
        if self._inflater is None:
            chunk = bytes(self._data[self._pos:self._pos + want])
            self._pos += len(chunk)
            return chunk
        out = self._pending[:want]
        self._pending = self._pending[want:]
        inflater = self._inflater
        try:
            while len(out) < want and not inflater.eof:
                tail = inflater.unconsumed_tail
                if not tail:
                    tail = bytes(self._data[self._pos:self._pos + CHUNK])
                    self._pos += len(tail)
                    if not tail:
                        raise _Limit(SnapshotFileError(f"{self.source}: the gzip stream is truncated"))
                out += inflater.decompress(tail, want - len(out))
        except zlib.error as exc:
            raise _Limit(SnapshotFileError(f"{self.source}: not a readable gzip file ({exc})")) from None
        return out

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = len(view)
        if want > MAX_SNAPSHOT_VALUE_BYTES:
            raise _Limit(SnapshotFileError(
                f"{self.source}: holds one value or pickle frame of {want:,} bytes, more than a memory snapshot holds "
                f"(the limit is {MAX_SNAPSHOT_VALUE_BYTES:,} bytes); a corrupt or hostile file"))
        self.check_objects()
        chunk = self._more(want)
        self.produced += len(chunk)
        if self.produced > self.max_bytes:
            raise _Limit(SnapshotFileError(
                f"{self.source}: decompresses to more than {self.max_bytes:,} bytes (the limit; raise it with "
                "--max-file-gb if the file is really this large)"))
        view[:len(chunk)] = chunk
        return len(chunk)


def _load_pickle(stream: _Stream) -> Any:
    reader = io.BufferedReader(stream, buffer_size=CHUNK)  # peek(): the unpickler reads ahead in blocks
    enabled = gc.isenabled()
    gc.disable()
    try:
        doc = _DataOnlyUnpickler(reader).load()
        stream.check_objects()
        return doc
    finally:
        if enabled:
            gc.enable()


def _load_json(stream: _Stream) -> Any:
    limit = min(stream.max_bytes, MAX_SNAPSHOT_JSON_BYTES)
    parts = []
    size = 0
    while size <= limit:
        part = stream.read(CHUNK)
        if not part:
            break
        parts.append(part)
        size += len(part)
    data = b"".join(parts)
    if size > limit:
        raise _Limit(SnapshotFileError(
            f"{stream.source}: a JSON snapshot of more than {limit:,} bytes (the limit for JSON, which is parsed "
            "whole: save it as a pickle with torch.cuda.memory._dump_snapshot(), or lower --max-file-gb)"))
    count = [0]

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        count[0] += 1
        if count[0] > stream.max_objects:
            raise _Limit(objects_limit_error(stream.source, stream.max_objects))
        return dict(items)

    return json.loads(data, object_pairs_hook=pairs)


def loads_data_pickle(data: bytes, max_objects: int = DEFAULT_MAX_OBJECTS) -> Any:
    """Unpickle `data` allowing only builtin data types; pickle.UnpicklingError (or SnapshotFileError) otherwise."""
    try:
        return _load_pickle(_Stream(data, "pickle", len(data), max_objects))
    except _Limit as exc:
        raise exc.error from None


def parse_snapshot_bytes(data: bytes, source: str = "snapshot", max_bytes: int = DEFAULT_MAX_BYTES,
                         max_objects: int = DEFAULT_MAX_OBJECTS) -> Any:
    """The document in `data`: JSON or a data-only pickle, either possibly gzip-compressed."""
    stream = _Stream(data, source, max_bytes, max_objects)
    try:
        start = stream.read(CHUNK)
        text = start.lstrip()
        head = text[:1]
        if not head and len(start) == CHUNK:
            raise SnapshotFileError(f"{source}: starts with {CHUNK:,} bytes of white space; not a memory snapshot")
        if not head:
            raise SnapshotFileError(f"{source}: the file is empty; expected a memory snapshot (JSON or pickle)")
        if head not in (b"{", b"[") and head[0] != PICKLE_PROTO:
            raise SnapshotFileError(f"{source}: neither JSON nor a pickle (it starts with {shown(text, 8)}); "
                                    "expected torch.cuda.memory_snapshot() as JSON or a "
                                    "torch.cuda.memory._dump_snapshot() pickle")
        stream = _Stream(data, source, max_bytes, max_objects)  # from the start again
        if head in (b"{", b"["):
            try:
                return _load_json(stream)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise SnapshotFileError(f"{source}: not valid JSON ({exc})") from None
            except RecursionError:
                raise SnapshotFileError(f"{source}: JSON nested too deeply to be a memory snapshot") from None
            except ValueError as exc:  # e.g. an integer of more than 4,300 digits
                raise SnapshotFileError(f"{source}: not a memory snapshot ({printable(str(exc), 200)})") from None
        try:
            return _load_pickle(stream)
        except pickle.UnpicklingError as exc:
            if "refers to the Python object" in str(exc) or "persistent" in str(exc):
                raise SnapshotFileError(f"{source}: refused: {exc}") from None
            raise SnapshotFileError(f"{source}: a truncated or corrupt pickle ({exc})") from None
        except RecursionError:
            raise SnapshotFileError(f"{source}: a pickle nested too deeply to be a memory snapshot") from None
        except (_Limit, SnapshotFileError):
            raise
        except MemoryError:
            raise SnapshotFileError(f"{source}: ran out of memory reading it; a corrupt or hostile pickle "
                                    "(lower --max-objects or --max-file-gb)") from None
        except Exception as exc:  # a corrupt pickle can raise almost anything (EOFError, KeyError, ...)
            raise SnapshotFileError(
                f"{source}: a truncated or corrupt pickle ({type(exc).__name__}: {printable(str(exc), 200)})") from None
    except _Limit as exc:
        raise exc.error from None


def read_snapshot_file(path: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES,
                       max_objects: int = DEFAULT_MAX_OBJECTS) -> Any:
    """Read and decode a snapshot file (JSON or data-only pickle, optionally gzip), within the limits."""
    source = str(path)
    if max_bytes < 1:
        raise SnapshotFileError(f"the size limit must be at least 1 byte, got {max_bytes}")
    if max_objects < 1:
        raise SnapshotFileError(f"the object limit must be at least 1, got {max_objects}")
    try:
        data = read_capped(Path(path), max_bytes, follow_symlinks=True)
    except FileTooLargeError as exc:
        raise SnapshotFileError(f"{exc}; refused before reading (the limit is {max_bytes:,} bytes; "
                                "raise it with --max-file-gb if the file is really this large)") from None
    except OSError as exc:
        raise SnapshotFileError(f"{source}: cannot read: {exc.strerror or exc}") from None
    return parse_snapshot_bytes(data, source, max_bytes, max_objects)


__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MAX_OBJECTS", "SnapshotFileError", "loads_data_pickle", "objects_limit_error",
           "parse_snapshot_bytes", "read_snapshot_file"]
