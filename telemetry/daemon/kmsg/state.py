"""The kmsg state file: last sequence number, boot id and counts, so a restart counts nothing twice.

Written atomically (temporary file in the same directory, fsync, rename), so a crash leaves either
the old or the new state. A reboot (new boot id) or a different log source starts from zero. A
missing or corrupt file is not an error: the daemon starts from zero, says so in one log line, and
moves a corrupt file aside for inspection.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from telemetry.daemon.kmsg.counts import CountsSnapshot

STATE_FILE_NAME = "kmsg-state.json"
STATE_VERSION = 1
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def read_boot_id(path: str = BOOT_ID_PATH) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "unknown"


@dataclass(frozen=True)
class LoadResult:
    snapshot: CountsSnapshot | None  # None: start from zero
    message: str  # one log line that says what happened and why
    problem: bool = False  # the file was there but unusable (logged as a warning)


class StateError(ValueError):
    pass


def _dict_of(value: object, kind: type, name: str) -> dict:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, kind) for k, v in value.items()):
        raise StateError(f"field {name!r} is not a mapping of names to {kind.__name__}")
    return dict(value)


def _int_of(data: dict, name: str) -> int:
    value = data.get(name)
    if not isinstance(value, int) or value < 0:
        raise StateError(f"field {name!r} is not a non-negative integer")
    return value


def decode_state(text: str) -> tuple[str, str, CountsSnapshot]:
    """(boot_id, source, snapshot) from the file's text; StateError says what is wrong."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StateError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise StateError("not a JSON object")
    if data.get("version") != STATE_VERSION:
        raise StateError(f"version {data.get('version')!r}, expected {STATE_VERSION}")
    boot_id, source = data.get("boot_id"), data.get("source")
    if not isinstance(boot_id, str) or not isinstance(source, str):
        raise StateError("boot_id or source missing")
    last_seq = data.get("last_seq")
    if last_seq is not None and (not isinstance(last_seq, int) or last_seq < 0):
        raise StateError("field 'last_seq' is not a non-negative integer")
    offset = data.get("stream_offset")
    if offset is not None and (not isinstance(offset, int) or offset < 0):
        raise StateError("field 'stream_offset' is not a non-negative integer")
    wall = data.get("last_seen_wall", {})
    if not isinstance(wall, dict) or not all(isinstance(v, (int, float)) for v in wall.values()):
        raise StateError("field 'last_seen_wall' is not a mapping of names to numbers")
    snapshot = CountsSnapshot(
        lines=_dict_of(data.get("lines"), int, "lines"),
        events=_dict_of(data.get("events"), int, "events"),
        event_start_usec=_dict_of(data.get("event_start_usec", {}), int, "event_start_usec"),
        last_seen_usec=_dict_of(data.get("last_seen_usec", {}), int, "last_seen_usec"),
        last_seen_wall={k: float(v) for k, v in wall.items()},
        records=_int_of(data, "records"),
        missed=_int_of(data, "missed"),
        state_write_failures=_int_of(data, "state_write_failures"),
        last_seq=last_seq,
        stream_offset=offset,
    )
    return boot_id, source, snapshot


def encode_state(snapshot: CountsSnapshot, boot_id: str, source: str) -> str:
    return json.dumps(
        {
            "version": STATE_VERSION,
            "boot_id": boot_id,
            "source": source,
            "last_seq": snapshot.last_seq,
            "stream_offset": snapshot.stream_offset,
            "records": snapshot.records,
            "missed": snapshot.missed,
            "state_write_failures": snapshot.state_write_failures,
            "lines": snapshot.lines,
            "events": snapshot.events,
            "event_start_usec": snapshot.event_start_usec,
            "last_seen_usec": snapshot.last_seen_usec,
            "last_seen_wall": snapshot.last_seen_wall,
        },
        sort_keys=True,
    )


def load_state(path: Path, boot_id: str, source: str) -> LoadResult:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return LoadResult(None, f"no kmsg state file at {path}: counting the kernel log from its oldest record")
    except (OSError, UnicodeDecodeError) as exc:
        return _set_aside(path, f"unreadable ({exc})")
    try:
        saved_boot, saved_source, snapshot = decode_state(text)
    except StateError as exc:
        return _set_aside(path, str(exc))
    if saved_boot != boot_id:
        return LoadResult(
            None, f"kmsg state file {path} is from another boot ({saved_boot}; now {boot_id}): counters start from 0"
        )
    if saved_source != source:
        return LoadResult(
            None, f"kmsg state file {path} was written for {saved_source}, now reading {source}: counters start from 0"
        )
    return LoadResult(
        snapshot, f"resuming kernel-log counts from {path}: boot {boot_id}, last sequence number {snapshot.last_seq}"
    )


def _set_aside(path: Path, reason: str) -> LoadResult:
    aside = path.with_name(path.name + ".corrupt")
    try:
        os.replace(path, aside)
        where = f"moved it to {aside}"
    except OSError as exc:
        where = f"could not move it aside ({exc})"
    return LoadResult(
        None,
        f"kmsg state file {path} is corrupt ({reason}); {where}; counters start from 0 and the kernel log is "
        "counted from its oldest record",
        problem=True,
    )


def save_state(path: Path, snapshot: CountsSnapshot, boot_id: str, source: str) -> None:
    """Atomically replace the state file. Raises OSError on failure (the caller counts it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = encode_state(snapshot, boot_id, source).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
