"""results.jsonl: one JSON object per event, appended and fsynced as it happens.

Every record has `event` and `ts` (unix seconds). The events, in the order a run writes them:
`run_start` (config snapshot, environment), `prompt`, `serve_start` / `serve_ready` / `serve_failed` /
`serve_stop`, `server_info`, `scrape` (phase `baseline` or `after`), `node_sample` (1 s samples during a
request), `request`, `step_skipped`, `arm_stopped`, `run_end`. A harness killed mid-write leaves at
most one broken last line; `read_records` drops it, so `--resume` and the report still work.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

RESULTS_FILE = "results.jsonl"


class RecordWriter:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._repair_tail()
        self._file = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()  # the node sampler thread writes too

    def _repair_tail(self) -> None:
        """A line cut by a kill would glue onto the next record: end it first."""
        if self.path.exists() and self.path.stat().st_size:
            with open(self.path, "rb+") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")

    def write(self, event: str, **fields) -> dict:
        record = {"event": event, "ts": time.time(), **fields}
        line = json.dumps(record, default=str, allow_nan=False) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()
            os.fsync(self._file.fileno())
        return record

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()


def read_records(path: Path) -> list[dict]:
    return list(iter_records(path))


def iter_records(path: Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            if isinstance(record, dict) and "event" in record:
                yield record


def step_key(arm: str, repeat: int, label: str) -> tuple[str, int, str]:
    return (arm, repeat, label)


def finished_steps(records: Iterable[dict]) -> set[tuple[str, int, str]]:
    """Steps that need no rerun: a request was recorded (ok or failed), or the step was skipped."""
    return {step_key(r["arm"], r["repeat"], r["step"]) for r in records
            if r["event"] in ("request", "step_skipped")}


def unstopped_servers(records: Iterable[dict]) -> list[dict]:
    """serve_start records without a serve_stop: servers a killed harness may have left running."""
    started: dict[int, dict] = {}
    for r in records:
        if r["event"] == "serve_start":
            started[r["pgid"]] = r
        elif r["event"] == "serve_stop":
            started.pop(r.get("pgid"), None)
    return list(started.values())
