"""/dev/kmsg records: a pure parser.

A record is `prio,seq,usec,flags[,more];message` followed by optional continuation lines that begin
with a space and carry `KEY=value` properties (SUBSYSTEM=, DEVICE=). `prio` packs the syslog
facility and level (`facility << 3 | level`); `usec` is the kernel's monotonic clock at logging
time. The kernel escapes unprintable bytes in the message as `\\xNN` (a newline inside a message is
`\\x0a`); we undo that. Lines without the header (a plain text log fed through `--kmsg FILE`) are
kept as a record with no sequence number, so they are still classified.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

_HEADER = re.compile(r"(\d+),(\d+),(\d+),([^,;]*)(?:,[^;]*)?;")
_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")


@dataclass(frozen=True)
class KmsgRecord:
    message: str
    level: int | None = None  # syslog level, 0 (emerg) .. 7 (debug)
    facility: int | None = None  # 0 = kernel, 1 = user (a write to /dev/kmsg), ...
    seq: int | None = None
    usec: int | None = None  # kernel monotonic time of the record, microseconds since boot
    flags: str = ""
    properties: dict[str, str] = field(default_factory=dict)


def unescape(text: str) -> str:
    if "\\x" not in text:
        return text
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), text)


def parse_record(text: str) -> KmsgRecord | None:
    """Parse one record (its header line and any continuation lines). Blank input gives None."""
    lines = text.rstrip("\n").split("\n")
    first = lines[0]
    if not first.strip():
        return None
    properties: dict[str, str] = {}
    for extra in lines[1:]:
        key, sep, value = extra.strip().partition("=")
        if sep:
            properties[key] = value
    match = _HEADER.match(first)
    if match is None:
        return KmsgRecord(message=unescape(first), properties=properties)
    prio = int(match.group(1))
    return KmsgRecord(
        message=unescape(first[match.end():]),
        level=prio & 7,
        facility=prio >> 3,
        seq=int(match.group(2)),
        usec=int(match.group(3)),
        flags=match.group(4),
        properties=properties,
    )


def split_records(lines: Iterable[str]) -> Iterator[str]:
    """Group a stream of lines into record texts: a line that starts with a space continues the last."""
    pending: list[str] = []
    for line in lines:
        if line.startswith(" ") and pending:
            pending.append(line)
            continue
        if pending:
            yield "\n".join(pending)
        pending = [line]
    if pending:
        yield "\n".join(pending)


def parse_records(text: str) -> list[KmsgRecord]:
    """Parse a whole dump (for example `cat /dev/kmsg` saved to a file) into records."""
    records = []
    for chunk in split_records(text.splitlines()):
        record = parse_record(chunk)
        if record is not None:
            records.append(record)
    return records
