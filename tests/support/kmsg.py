"""The one way tests write into the machine's kernel log: opt-in, and every line marked.

`scripts/test` as root must leave a real box's kernel log alone: a test that writes into /dev/kmsg
runs only with `MEMTEL_TEST_KMSG=1` (CI's `.ci/run` sets it) and skips otherwise, saying how to opt
in. Every line it writes starts with `TEST_LINE_MARKER` ("memtel-test:"), which memtel's daemon
reads but counts nowhere by default (`kmsg.ignore_test_lines: true`), so even CI's fake Xid and
NV_ERR_NO_MEMORY lines raise no alert on a monitored box; the tests' own daemons count them with
`DAEMON_COUNTS_TEST_LINES` (`--kmsg-count-test-lines`).
"""

from __future__ import annotations

import os
import re
import time

import pytest

from telemetry.daemon.kmsg.classify import TEST_LINE_MARKER

OPT_IN_ENV = "MEMTEL_TEST_KMSG"
KMSG = "/dev/kmsg"
DAEMON_COUNTS_TEST_LINES = ("--kmsg-count-test-lines",)
SKIP_REASON = (f"writes into the machine's kernel log (/dev/kmsg): opt in with {OPT_IN_ENV}=1 "
               "(CI's .ci/run does); every line carries the 'memtel-test:' marker")
_PRIORITY = re.compile(r"^<\d{1,3}>")


def opted_in() -> bool:
    return os.environ.get(OPT_IN_ENV) == "1"


def require_opt_in() -> None:
    """Skip the calling test unless kernel-log writes were asked for (and we may write)."""
    if not opted_in():
        pytest.skip(SKIP_REASON)
    if not os.access(KMSG, os.W_OK):
        pytest.fail(f"{OPT_IN_ENV}=1 but {KMSG} is not writable: the kmsg tests need root")


def marked(line: str) -> str:
    """`line` with the test marker in front (after a `<N>` priority prefix, which the kernel strips)."""
    line = line.rstrip("\n")
    prefix = _PRIORITY.match(line)
    head = prefix.group(0) if prefix else ""
    body = line[len(head):]
    if body.startswith(TEST_LINE_MARKER):
        return line
    return f"{head}{TEST_LINE_MARKER} {body}"


def write_kmsg(lines: list[str] | tuple[str, ...] | str, pace_every: int = 100, pace_seconds: float = 0.02) -> None:
    """Write marked lines into the kernel log, one open per line (the kernel rate-limits a writer to 10
    lines per 5 s per open file), paced a little so a reader keeps up with a 128 KiB ring buffer."""
    require_opt_in()
    if isinstance(lines, str):
        lines = [lines]
    for i, line in enumerate(lines):
        fd = os.open(KMSG, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, marked(line).encode() + b"\n")
        finally:
            os.close(fd)
        if pace_every and i % pace_every == pace_every - 1:
            time.sleep(pace_seconds)


__all__ = ["DAEMON_COUNTS_TEST_LINES", "OPT_IN_ENV", "SKIP_REASON", "TEST_LINE_MARKER", "marked", "opted_in",
           "require_opt_in", "write_kmsg"]
