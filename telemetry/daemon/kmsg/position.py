"""The kernel-log position that survives a lost state directory: boot id, source, sequence number (issue 38).

The state file (state.py) keeps the counts with the position; when it is gone (a state directory on a
volume that was replaced, wiped or never mounted) a new daemon used to read the ring buffer from its
oldest record and count every old line again: a counter that restarts from 0 and climbs back looks like an
increase to Prometheus, and the kernel-log alerts raised a 15-minute ticket for lines an earlier daemon had
counted. This small file lives in the runtime directory (a tmpfs, cleared at reboot: exactly a boot's life)
and says only where the last daemon of this boot stopped. A new daemon without a state file resumes after
it with counters from 0 (Prometheus sees a counter reset, no increase). A boot id of "unknown" tells no
boot from another and is never trusted. Written and read like the state file: atomically, size-capped,
strictly decoded; anything else is ignored with one log line.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from telemetry.safefs import read_capped, write_atomic

POSITION_FILE_NAME = "kmsg-position.json"
MAX_POSITION_BYTES = 4096
_MAX_SEQ = 2**63 - 1


@dataclass(frozen=True)
class Position:
    boot_id: str
    source: str
    last_seq: int
    last_usec: int | None


def default_position_path(state_dir: Path) -> Path | None:
    """Where the position of the daemon whose state directory is `state_dir` lives: systemd's RuntimeDirectory=
    ($RUNTIME_DIRECTORY), or /run/memtel as root; None (no position kept) for anyone else. Named for the state
    directory's path, which stays when its contents are lost: two daemons with their own state directories (a
    test suite's) never share a position."""
    if os.environ.get("RUNTIME_DIRECTORY"):
        runtime = Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0])
    elif os.geteuid() == 0:
        runtime = Path("/run/memtel")
    else:
        return None
    digest = hashlib.sha256(str(Path(state_dir).absolute()).encode()).hexdigest()[:16]
    return runtime / POSITION_FILE_NAME.replace(".json", f"-{digest}.json")


def save_position(path: Path, position: Position) -> None:
    """Atomically replace the position file (its directory made 0700 if missing). Raises OSError."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"boot_id": position.boot_id, "source": position.source,
                                   "last_seq": position.last_seq, "last_usec": position.last_usec},
                                  sort_keys=True).encode())


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is no sequence number")


def load_position(path: Path, boot_id: str, source: str) -> tuple[Position | None, str]:
    """The saved position if it is this boot's (a known boot id) and this source's, and why not otherwise."""
    if boot_id == "unknown":
        return None, "the boot id is unknown: no saved kernel-log position can be trusted"
    try:
        raw = read_capped(path, MAX_POSITION_BYTES)
    except FileNotFoundError:
        return None, f"no kernel-log position at {path}"
    except OSError as exc:
        return None, f"kernel-log position {path} unreadable ({exc.strerror or exc})"
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
        seq, usec = data["last_seq"], data.get("last_usec")
        valid = (isinstance(data.get("boot_id"), str) and isinstance(data.get("source"), str)
                 and type(seq) is int and 0 <= seq <= _MAX_SEQ
                 and (usec is None or (type(usec) is int and 0 <= usec <= _MAX_SEQ)))
    except (ValueError, TypeError, KeyError, RecursionError, AttributeError):
        valid = False
    if not valid:
        return None, f"kernel-log position {path} is not one (ignored)"
    if data["boot_id"] != boot_id or data["source"] != source:
        return None, f"kernel-log position {path} is another boot's or source's"
    return Position(boot_id, source, seq, usec), f"resuming after kernel-log record {seq} ({path})"
