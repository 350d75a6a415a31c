"""Helpers for the daemon tests: run the real daemon as a subprocess, scrape it, write the kernel log."""

from __future__ import annotations

import contextlib
import http.server
import os
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.cli import call_main
from tests.support.kmsg import write_kmsg  # noqa: F401  (the one writer: opt-in, marked lines)
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

    def value(self, name: str, **labels: str) -> Any:
        """The sample's value (a float), or None where the series is absent (typed Any for terse asserts)."""
        return self.samples.get((name, tuple(sorted(labels.items()))))

    def names(self) -> set[str]:
        return {name for name, _ in self.samples}


D = TypeVar("D", bound="Daemon")
T = TypeVar("T")


class Daemon:
    """`python -m telemetry daemon` on a free loopback port; always stopped by the context manager."""

    def __init__(self, state_dir: Path, *args: str, port: int | None = None, log_path: Path | None = None,
                 prefix: tuple[str, ...] = (), tls_ca: Path | None = None,
                 auth: tuple[str, str] | None = None, client_cert: tuple[Path, Path] | None = None) -> None:
        self.prefix = prefix  # e.g. setpriv with a reduced capability set
        self.port = port or free_port()
        self.state_dir = state_dir
        self.args = args
        self.log_path = log_path or state_dir.parent / f"daemon-{self.port}-{uuid.uuid4().hex[:6]}.log"
        self._proc: subprocess.Popen | None = None
        # With a web config: the CA that signed the server's certificate, and basic-auth credentials.
        self.url = f"{'https' if tls_ca else 'http'}://127.0.0.1:{self.port}"
        verify: ssl.SSLContext | bool = True
        if tls_ca:
            verify = ssl.create_default_context(cafile=str(tls_ca))
            if client_cert:
                verify.load_cert_chain(*map(str, client_cert))
        self.http_options: dict = {"verify": verify, "auth": auth}

    @property
    def proc(self) -> subprocess.Popen:
        assert self._proc is not None, "the daemon was not started"
        return self._proc

    def start(self: D, wait: bool = True) -> D:
        self._log = open(self.log_path, "ab")  # noqa: SIM115  (kept open while the daemon runs; closed by stop())
        cmd = [*self.prefix, sys.executable, "-m", "telemetry", "daemon", "--listen", f"127.0.0.1:{self.port}",
               "--state-dir", str(self.state_dir), *self.args]
        self._proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1, **self.http_options).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"daemon not ready after {timeout}s:\n{self.log()}")

    def scrape(self) -> Scrape:
        response = httpx.get(self.url + "/metrics", timeout=5, **self.http_options)
        assert response.status_code == 200, response.text
        return Scrape(response.text)

    def stop(self) -> int:
        if self._proc is None:
            return 0
        try:
            if self.proc.poll() is not None:
                return self.proc.returncode
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

    def __enter__(self: D) -> D:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def all_started(*daemons: Daemon) -> Iterator[tuple[Daemon, ...]]:
    """Start every daemon at once (their Python starts overlap), wait until each answers, stop all at exit."""
    try:
        for daemon in daemons:
            daemon.start(wait=False)
        for daemon in daemons:
            daemon.wait_ready()
        yield daemons
    finally:
        for daemon in daemons:
            daemon.stop()


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "telemetry", "daemon", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def check_config(*args: str) -> subprocess.CompletedProcess:
    """`memtel daemon ARGS --check-config` in this process (tests/support/cli.py). `--check-config` is always
    given, so a configuration that wrongly passes prints "configuration OK" and returns: nothing starts here."""
    return call_main(["daemon", *args, "--check-config"])


# -- the real kernel log (written only through tests.support.kmsg) ---------------------------------------
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


def wait_for(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.05, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


# -- a stand-in exporter: a fixed /metrics text on a loopback port ---------------------------------------
@contextlib.contextmanager
def static_exporter(text: str | bytes) -> Iterator[str]:
    """Serve `text` on every GET at 127.0.0.1:<free port>; yields "127.0.0.1:<port>", stops at exit."""
    body = text.encode() if isinstance(text, str) else text

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()

