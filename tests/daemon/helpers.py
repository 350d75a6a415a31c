"""Helpers for the daemon tests: run the real daemon as a subprocess, scrape it, write the kernel log."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


class Scrape:
    def __init__(self, text: str) -> None:
        self.text = text
        self.samples = parse_metrics(text)

    def value(self, name: str, **labels: str) -> float | None:
        return self.samples.get((name, tuple(sorted(labels.items()))))

    def names(self) -> set[str]:
        return {name for name, _ in self.samples}


class Daemon:
    """`python -m telemetry daemon` on a free loopback port; always stopped by the context manager."""

    def __init__(self, state_dir: Path, *args: str, port: int | None = None, log_path: Path | None = None,
                 prefix: tuple[str, ...] = ()) -> None:
        self.prefix = prefix  # e.g. setpriv with a reduced capability set
        self.port = port or free_port()
        self.state_dir = state_dir
        self.args = args
        self.log_path = log_path or state_dir.parent / f"daemon-{self.port}-{uuid.uuid4().hex[:6]}.log"
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self, wait: bool = True) -> Daemon:
        self._log = open(self.log_path, "ab")
        cmd = [*self.prefix, sys.executable, "-m", "telemetry", "daemon", "--listen", f"127.0.0.1:{self.port}",
               "--state-dir", str(self.state_dir), *self.args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"daemon not ready after {timeout}s:\n{self.log()}")

    def scrape(self) -> Scrape:
        response = httpx.get(self.url + "/metrics", timeout=5)
        assert response.status_code == 200, response.text
        return Scrape(response.text)

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise AssertionError("daemon did not stop within 10 s of SIGTERM") from None
        finally:
            self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "telemetry", "daemon", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


# -- the real kernel log --------------------------------------------------------------------------------
def write_kmsg(lines: list[str], pace_every: int = 100, pace_seconds: float = 0.02) -> None:
    """One open per line: the kernel rate-limits /dev/kmsg writers to 10 lines per 5 s per open file.
    Paced a little so a reader keeps up with the 128 KiB ring buffer of small machines."""
    for i, line in enumerate(lines):
        fd = os.open("/dev/kmsg", os.O_WRONLY)
        try:
            os.write(fd, line.encode() + b"\n")
        finally:
            os.close(fd)
        if pace_every and i % pace_every == pace_every - 1:
            time.sleep(pace_seconds)


_RECORD = re.compile(r"^(\d+),(\d+),(\d+),[^;]*;(.*)$")


def read_kmsg() -> list[tuple[int, int, str]]:
    """(seq, usec, message) of every record now in the kernel log (an independent reader, the oracle)."""
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    records = []
    try:
        while True:
            try:
                chunk = os.read(fd, 16384)
            except BlockingIOError:
                break
            except BrokenPipeError:
                continue
            match = _RECORD.match(chunk.decode(errors="replace").split("\n", 1)[0])
            if match:
                records.append((int(match.group(2)), int(match.group(3)), match.group(4)))
    finally:
        os.close(fd)
    return records


class KmsgTap:
    """An independent reader of /dev/kmsg from "now" on, in a thread, so records the ring buffer overwrites
    later are still seen (the oracle for the 1,000-line burst). `overrun` is set if it fell behind itself."""

    def __init__(self) -> None:
        import threading

        self.records: list[tuple[int, int, str]] = []
        self.overrun = False
        self._fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
        os.lseek(self._fd, 0, os.SEEK_END)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import select

        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        while True:
            try:
                chunk = os.read(self._fd, 16384)
            except BlockingIOError:
                if self._stop.is_set():
                    return
                poller.poll(20)
                continue
            except BrokenPipeError:
                self.overrun = True
                continue
            match = _RECORD.match(chunk.decode(errors="replace").split("\n", 1)[0])
            if match:
                self.records.append((int(match.group(2)), int(match.group(3)), match.group(4)))

    def __enter__(self) -> KmsgTap:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.05)
        self._stop.set()
        self._thread.join(5)
        os.close(self._fd)

    def seq_of(self, text: str) -> int:
        return next(seq for seq, _, msg in self.records if text in msg)


def between(records: list[tuple[int, int, str]], start: str, end: str) -> list[tuple[int, int, str]]:
    """Records strictly between the record containing `start` and the one containing `end`."""
    start_i = next(i for i, r in enumerate(records) if start in r[2])
    end_i = next(i for i, r in enumerate(records) if end in r[2])
    return records[start_i + 1:end_i]


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
