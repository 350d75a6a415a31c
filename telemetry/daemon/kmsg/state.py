"""The kmsg state file: last sequence number, boot id and counts, so a restart counts nothing twice.

Written with `safefs.write_atomic` (whole, size-checked, fsynced, renamed, directory fsynced), so a
crash or a full disk leaves either the old or the new state, never a torn one. Read back with a size
cap and a strict decoder: whatever is in the file (garbage, deep nesting, huge numbers, NaN, 2 GB of
anything, a symlink, a FIFO) it is either a valid state or it is moved aside (`NAME.corrupt-<time>`)
with one log line and the daemon starts from zero. A reboot (new boot id) or a different log source
also starts from zero. The state-write failure counter is kept across restarts (it is in the state).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from telemetry.daemon.kmsg.counts import CountsSnapshot
from telemetry.safefs import FileTooLargeError, move_aside, read_capped, write_atomic

STATE_FILE_NAME = "kmsg-state.json"
STATE_VERSION = 1
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
MAX_STATE_BYTES = 1 << 20  # a real state is a few kilobytes: Xid codes and patterns are bounded
MAX_COUNTER = 2**63 - 1
MAX_KINDS = 4096
_MAX_INT_DIGITS = 20


def read_boot_id(path: str = BOOT_ID_PATH) -> str:
    try:
        text = read_capped(path, 256, follow_symlinks=True).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return "unknown"
    return text if text and text.isprintable() else "unknown"


@dataclass(frozen=True)
class LoadResult:
    snapshot: CountsSnapshot | None  # None: start from zero
    message: str  # one log line that says what happened and why
    problem: bool = False  # the file was there but unusable (logged as a warning)
    state_write_failures: int = 0  # kept even when the counts are not (another boot or source)


class StateError(ValueError):
    pass


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise StateError(f"an integer of {len(text)} digits")
    return int(text)


def _parse_constant(name: str) -> float:
    raise StateError(f"{name} is not a number this file may hold")


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNTER:
        raise StateError(f"field {name!r} is not a counter (an integer from 0 to 2^63-1)")
    return value


def _counts_of(value: Any, name: str) -> dict[str, int]:
    if not isinstance(value, dict) or len(value) > MAX_KINDS:
        raise StateError(f"field {name!r} is not a mapping of at most {MAX_KINDS} names to counters")
    return {str(k)[:256]: _count(v, f"{name}.{k}") for k, v in value.items()}


def _times_of(value: Any, name: str) -> dict[str, float]:
    if not isinstance(value, dict) or len(value) > MAX_KINDS:
        raise StateError(f"field {name!r} is not a mapping of names to times")
    out = {}
    for k, v in value.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e11:
            raise StateError(f"field {name}.{k} is not a Unix time")
        out[str(k)[:256]] = float(v)
    return out


def _optional_count(data: dict[str, Any], name: str) -> int | None:
    value = data.get(name)
    return None if value is None else _count(value, name)


def decode_state(raw: bytes) -> tuple[str, str, CountsSnapshot]:
    """(boot_id, source, snapshot) from the file's bytes; StateError says what is wrong."""
    try:
        data = json.loads(raw.decode("utf-8"), parse_int=_parse_int, parse_constant=_parse_constant)
    except UnicodeDecodeError:
        raise StateError("not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise StateError(f"not JSON: {exc}") from None
    except RecursionError:
        raise StateError("nested too deeply") from None
    if not isinstance(data, dict):
        raise StateError("not a JSON object")
    if data.get("version") != STATE_VERSION:
        raise StateError(f"version {str(data.get('version'))[:20]!r}, expected {STATE_VERSION}")
    boot_id, source = data.get("boot_id"), data.get("source")
    if not isinstance(boot_id, str) or not isinstance(source, str) or len(boot_id) > 256 or len(source) > 4096:
        raise StateError("boot_id or source missing")
    snapshot = CountsSnapshot(
        lines=_counts_of(data.get("lines"), "lines"),
        events=_counts_of(data.get("events"), "events"),
        event_start_usec=_counts_of(data.get("event_start_usec", {}), "event_start_usec"),
        last_seen_usec=_counts_of(data.get("last_seen_usec", {}), "last_seen_usec"),
        last_seen_wall=_times_of(data.get("last_seen_wall", {}), "last_seen_wall"),
        records=_count(data.get("records"), "records"),
        missed=_count(data.get("missed"), "missed"),
        state_write_failures=_count(data.get("state_write_failures"), "state_write_failures"),
        ignored_test_lines=_count(data.get("ignored_test_lines", 0), "ignored_test_lines"),
        last_seq=_optional_count(data, "last_seq"),
        last_usec=_optional_count(data, "last_usec"),
        stream_offset=_optional_count(data, "stream_offset"),
    )
    return boot_id, source, snapshot


def encode_state(snapshot: CountsSnapshot, boot_id: str, source: str) -> bytes:
    return json.dumps(
        {
            "version": STATE_VERSION,
            "boot_id": boot_id,
            "source": source,
            "last_seq": snapshot.last_seq,
            "last_usec": snapshot.last_usec,
            "stream_offset": snapshot.stream_offset,
            "records": snapshot.records,
            "missed": snapshot.missed,
            "ignored_test_lines": snapshot.ignored_test_lines,
            "state_write_failures": snapshot.state_write_failures,
            "lines": snapshot.lines,
            "events": snapshot.events,
            "event_start_usec": snapshot.event_start_usec,
            "last_seen_usec": snapshot.last_seen_usec,
            "last_seen_wall": snapshot.last_seen_wall,
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()


def load_state(path: Path, boot_id: str, source: str) -> LoadResult:
    try:
        raw = read_capped(path, MAX_STATE_BYTES)
    except FileNotFoundError:
        return LoadResult(None, f"no kmsg state file at {path}: counting the kernel log from its oldest record")
    except FileTooLargeError as exc:
        return _set_aside(path, str(exc))
    except OSError as exc:  # a symlink (ELOOP), a directory, a FIFO, no permission ...
        return _set_aside(path, f"unreadable: {exc.strerror or exc}")
    try:
        saved_boot, saved_source, snapshot = decode_state(raw)
    except (StateError, ValueError) as exc:
        return _set_aside(path, str(exc)[:200])
    failures = snapshot.state_write_failures
    if saved_boot != boot_id:
        return LoadResult(
            None, f"kmsg state file {path} is from another boot ({saved_boot}; now {boot_id}): counters start from 0",
            state_write_failures=failures,
        )
    if saved_source != source:
        return LoadResult(
            None, f"kmsg state file {path} was written for {saved_source}, now reading {source}: counters start from 0",
            state_write_failures=failures,
        )
    return LoadResult(
        snapshot, f"resuming kernel-log counts from {path}: boot {boot_id}, last sequence number {snapshot.last_seq}",
        state_write_failures=failures,
    )


def _set_aside(path: Path, reason: str) -> LoadResult:
    try:
        where = f"moved it to {move_aside(path)}"
    except OSError as exc:
        where = f"could not move it aside ({exc.strerror or exc})"
    return LoadResult(
        None,
        f"kmsg state file {path} is corrupt ({reason}); {where}; counters start from 0 and the kernel log is "
        "counted from its oldest record",
        problem=True,
    )


def save_state(path: Path, snapshot: CountsSnapshot, boot_id: str, source: str) -> None:
    """Atomically replace the state file (safefs.write_atomic). Raises OSError on failure (the caller counts it)."""
    write_atomic(path, encode_state(snapshot, boot_id, source))
