"""`memtel alerts burn-in --minutes N`: record this machine's own timeline and hand it to the score.

It runs `memtel daemon` (this interpreter, a private state directory, the flight recorder at one record a
second, listening on loopback) for N minutes while the machine does what it does, stops it with SIGTERM,
reads the flight ring and returns it as a benign timeline: a rule that fires on it would have fired on this
box while nothing failed. Nothing is left running: the daemon is stopped on every exit path.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

from telemetry.alerts.timeline import HEADER_KEY, Outcome, Record, Timeline
from telemetry.errors import ConfigError, RunError

MIN_MINUTES, MAX_MINUTES = 0.5, 1440.0
START_TIMEOUT_S = 60.0


def _ring_records(state_dir: Path) -> list[Record]:
    from telemetry.flight.recorder import CURRENT_RING
    from telemetry.flight.ring import RingFormatError, read_ring

    path = state_dir / "flight" / CURRENT_RING
    try:
        contents = read_ring(path)
    except (OSError, RingFormatError) as exc:
        raise RunError(f"burn-in: the daemon's flight ring {path} is unreadable: {exc}") from None
    return [Record(r.time, dict(r.values)) for r in contents.records]


def burn_in(minutes: float, state_dir: str | None, listen: str, out: str | None,
            progress: TextIO = sys.stderr) -> Timeline:
    if not MIN_MINUTES <= minutes <= MAX_MINUTES:
        raise ConfigError(f"--minutes {minutes:g}: expected {MIN_MINUTES:g} to {MAX_MINUTES:g}")
    if out is not None and not Path(out).parent.is_dir():
        raise ConfigError(f"--out {out}: the directory {Path(out).parent} does not exist")
    with tempfile.TemporaryDirectory(prefix="memtel-burn-in-") as scratch:
        state = Path(state_dir) if state_dir else Path(scratch) / "state"
        seconds = minutes * 60
        command = [sys.executable, "-m", "telemetry", "daemon", "--state-dir", str(state), "--listen", listen,
                   "--flight-duration", f"{int(seconds) + 120}s", "--log-level", "warning"]
        log_path = Path(scratch) / "daemon.log"
        with open(log_path, "wb") as log:
            daemon = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
            try:
                ring = state / "flight" / "current.ring"
                deadline = time.monotonic() + START_TIMEOUT_S
                while not ring.exists():
                    if daemon.poll() is not None:
                        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
                        raise RunError(f"burn-in: the daemon exited with {daemon.returncode}: {tail[0][:300]}")
                    if time.monotonic() > deadline:
                        raise RunError(f"burn-in: the daemon started no flight ring within {START_TIMEOUT_S:g} s")
                    time.sleep(0.2)
                print(f"memtel alerts burn-in: recording this machine for {minutes:g} min (daemon pid "
                      f"{daemon.pid}, state {state})", file=progress, flush=True)
                end = time.monotonic() + seconds
                while (left := end - time.monotonic()) > 0:
                    if daemon.poll() is not None:
                        raise RunError(f"burn-in: the daemon exited early with {daemon.returncode}")
                    time.sleep(min(left, 1.0))
            finally:
                if daemon.poll() is None:
                    daemon.send_signal(signal.SIGTERM)
                    try:
                        daemon.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        daemon.kill()
                        daemon.wait()
        records = _ring_records(state)
    if len(records) < 2:
        raise RunError("burn-in: the flight recorder kept fewer than 2 records")
    node = (os.uname().nodename.split(".")[0] or "this-node")[:63]
    outcome = Outcome("benign", node=node if node[0].isalnum() else "this-node",
                      description=f"memtel alerts burn-in: {minutes:g} min on {os.uname().nodename}")
    timeline = Timeline("burn-in", outcome, tuple(records))
    if out is not None:
        with open(out, "w") as handle:
            handle.write(json.dumps({HEADER_KEY: {"outcome": "benign", "node": outcome.node,
                                                  "description": outcome.description}}) + "\n")
            for record in records:
                handle.write(json.dumps({"time": record.time, "values": record.values}) + "\n")
    return timeline
