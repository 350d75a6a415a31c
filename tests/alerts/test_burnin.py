"""Teeth for `memtel alerts burn-in` (telemetry/alerts/burnin.py, issue 30's mutation testing) in a fraction of a
second: what it runs, how it waits for the flight ring, how it stops, what it reads back and writes.

The real burn-in (tests/alerts/test_score.py, slow) records this machine for 30 s through the real daemon. Here
the daemon is a stand-in, a shell script run as `sys.executable`: it notes its arguments, then puts a flight ring
written by the real FlightRecorder where the daemon keeps its own (one `mv`, so it appears whole) and waits for
SIGTERM; or it fails the ways a daemon can. The recording lasts 0.1 s (the shortest accepted, 0.5 min, is
lowered for these tests)."""

from __future__ import annotations

import io
import json
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from telemetry.alerts import burnin
from telemetry.alerts.timeline import load_timeline
from telemetry.errors import RunError
from telemetry.flight.recorder import FlightRecorder

T0 = 1_764_547_200.0
SECONDS = 0.1
DAEMON = """#!/bin/sh
printf '%s\\n' "$@" > "$BURN_IN_DIR/args"
while [ $# -gt 0 ]; do [ "$1" = --state-dir ] && state=$2; shift; done
case "$BURN_IN_MODE" in
  fail) echo "starting" >&2; printf 'memtel daemon: error: /dev/kmsg: \\377 denied\\n' >&2; exit 3 ;;
  silent) exec sleep 30 ;;
esac
mkdir -p "$state" && cp -r "$BURN_IN_DIR/flight" "$state/.flight" && mv "$state/.flight" "$state/flight"
[ "$BURN_IN_MODE" = quit ] && sleep 0.05 && exit 0
exec sleep 30
"""


@pytest.fixture
def daemon(tmp_path, monkeypatch):
    """The stand-in daemon (see the module's doc) with a ring of `records` records of the real recorder."""
    script = tmp_path / "daemon.sh"
    script.write_text(DAEMON)
    script.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(script))
    monkeypatch.setattr(burnin, "MIN_MINUTES", SECONDS / 60)
    monkeypatch.setenv("BURN_IN_DIR", str(tmp_path))

    def ring(records: int) -> list[dict[str, float]]:
        recorder = FlightRecorder(tmp_path / "flight", "burn-in-test-boot", duration_seconds=60, interval_seconds=1)
        recorder.prepare()
        values = [{"memtel_node_unified_headroom_bytes": 3e10 - i, 'memtel_gpu_info{name="x"}': 1.0}
                  for i in range(records)]
        for i, record in enumerate(values):
            assert recorder.record(record, T0 + i)
        return values

    return ring


def args(tmp_path: Path) -> list[str]:
    return (tmp_path / "args").read_text().splitlines()


def test_it_runs_the_daemon_records_and_writes_the_timeline(daemon, tmp_path, capsys):
    values = daemon(3)
    out = tmp_path / "kept.jsonl"
    written: list[str] = []

    class Progress:
        def write(self, text: str) -> None:
            written.append(text)

        def flush(self) -> None:
            written.append("<flush>")

    timeline = burnin.burn_in(SECONDS / 60, str(tmp_path / "state"), "127.0.0.1:0", str(out), Progress())
    assert args(tmp_path) == ["-m", "telemetry", "daemon", "--state-dir", str(tmp_path / "state"), "--listen",
                              "127.0.0.1:0", "--flight-duration", "120s", "--log-level", "warning"]
    assert re.fullmatch(rf"memtel alerts burn-in: recording this machine for {SECONDS / 60:g} min \(daemon pid "
                        rf"\d+, state {re.escape(str(tmp_path / 'state'))}\)\n<flush>", "".join(written)), written
    assert timeline.name == "burn-in" and [r.values for r in timeline.records] == values
    assert [r.time for r in timeline.records] == [T0, T0 + 1, T0 + 2]
    node = os.uname().nodename.split(".")[0][:63]
    assert timeline.outcome.kind == "benign" and timeline.outcome.failure_at is None
    assert timeline.outcome.node == (node if node[:1].isalnum() else "this-node")
    assert timeline.outcome.description == f"memtel alerts burn-in: {SECONDS / 60:g} min on {os.uname().nodename}"
    kept = load_timeline(out)
    assert kept.outcome == timeline.outcome and kept.records == timeline.records
    header = json.loads(out.read_text().splitlines()[0])
    assert header == {"memtel_timeline": {"outcome": "benign", "node": timeline.outcome.node,
                                          "description": timeline.outcome.description}}
    assert capsys.readouterr().err == ""


def test_without_a_state_dir_it_uses_a_scratch_one_and_leaves_nothing(daemon, tmp_path, monkeypatch):
    daemon(2)
    monkeypatch.setattr(os, "uname", lambda: SimpleNamespace(nodename="n" * 70 + ".lab.example"))
    out = tmp_path / "kept.jsonl"
    timeline = burnin.burn_in(SECONDS / 60, None, "127.0.0.1:9", str(out), io.StringIO())
    state = args(tmp_path)[4]
    assert state.endswith("/state") and "memtel-burn-in-" in state and not Path(state).exists()
    assert args(tmp_path)[6] == "127.0.0.1:9" and len(timeline.records) == 2
    assert timeline.outcome.node == "n" * 63   # a host name's longest label: the timeline loads again
    assert load_timeline(out).outcome.node == "n" * 63


@pytest.mark.parametrize("nodename", ["-x.lab", ".lab"])
def test_a_node_name_that_is_no_host_name_is_this_node(daemon, tmp_path, monkeypatch, nodename):
    daemon(2)
    monkeypatch.setattr(os, "uname", lambda: SimpleNamespace(nodename=nodename))
    timeline = burnin.burn_in(SECONDS / 60, str(tmp_path / "state"), "127.0.0.1:0", None, io.StringIO())
    assert timeline.outcome.node == "this-node"
    assert timeline.outcome.description == f"memtel alerts burn-in: {SECONDS / 60:g} min on {nodename}"


def test_a_daemon_that_fails_to_start_is_its_last_line(daemon, tmp_path, monkeypatch):
    monkeypatch.setenv("BURN_IN_MODE", "fail")
    # Its last line, the byte that is not UTF-8 replaced.
    with pytest.raises(RunError, match=re.escape("burn-in: the daemon exited with 3: memtel daemon: error: "
                                                 "/dev/kmsg: \ufffd denied")):
        burnin.burn_in(SECONDS / 60, str(tmp_path / "state"), "127.0.0.1:0", None, io.StringIO())


def test_a_daemon_that_never_starts_its_ring_is_stopped(daemon, tmp_path, monkeypatch):
    monkeypatch.setenv("BURN_IN_MODE", "silent")
    monkeypatch.setattr(burnin, "START_TIMEOUT_S", 0.3)
    with pytest.raises(RunError, match=r"^burn-in: the daemon started no flight ring within 0.3 s$"):
        burnin.burn_in(SECONDS / 60, str(tmp_path / "state"), "127.0.0.1:0", None, io.StringIO())


def test_a_daemon_that_stops_while_recording_is_an_error(daemon, tmp_path, monkeypatch):
    daemon(3)
    monkeypatch.setenv("BURN_IN_MODE", "quit")
    with pytest.raises(RunError, match=r"^burn-in: the daemon exited early with 0$"):
        burnin.burn_in(0.5 / 60, str(tmp_path / "state"), "127.0.0.1:0", None, io.StringIO())


def test_fewer_than_two_records_is_an_error(daemon, tmp_path):
    daemon(1)
    with pytest.raises(RunError, match=r"^burn-in: the flight recorder kept fewer than 2 records$"):
        burnin.burn_in(SECONDS / 60, str(tmp_path / "state"), "127.0.0.1:0", None, io.StringIO())


def test_an_unreadable_ring_is_named(tmp_path):
    (tmp_path / "flight").mkdir()
    (tmp_path / "flight" / "current.ring").write_bytes(b"not a ring")
    with pytest.raises(RunError, match=f"^burn-in: the daemon's flight ring {tmp_path / 'flight' / 'current.ring'} "
                                       "is unreadable: "):
        burnin._ring_records(tmp_path)
