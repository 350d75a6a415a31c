"""Classify kernel log lines by meaning. Pure: a record in, the kinds it belongs to out.

Kinds are strings used as counter keys: `nv_err_no_memory`, `nvrm_error`, `xid:<code>`, `oom_kill`
and `pattern:<name>` for user patterns. One line may have several kinds (an Xid line is also an
NVRM error line); a line with none is counted nowhere.

Matching is by meaning rather than one exact string, because the driver words the same failure
differently across versions and call sites, e.g.
  NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) returned from ...
  NVRM: nvAssertOkFailedNoLog: Assertion failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) ...
  nvidia-uvm: ... status: NV_ERR_NO_MEMORY
  NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001
  NVRM: Xid (0000:01:00): 13, Graphics Exception ...
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from telemetry.daemon.kmsg.record import KmsgRecord
from telemetry.daemon.patterns import Searcher

NV_ERR_NO_MEMORY = "nv_err_no_memory"
NVRM_ERROR = "nvrm_error"
OOM_KILL = "oom_kill"
XID_PREFIX = "xid:"
PATTERN_PREFIX = "pattern:"
# Every line memtel's own test suite writes into the kernel log starts with this (tests/support/kmsg.py);
# the daemon reads such lines but counts them nowhere unless kmsg.ignore_test_lines is false.
TEST_LINE_MARKER = "memtel-test:"

_NVRM = re.compile(r"\bNVRM\b")
# The status by name anywhere (NVRM or nvidia-uvm), or in an NVRM line by its wording or its code 0x51.
_NO_MEMORY_NAME = re.compile(r"\bNV_ERR_NO_MEMORY\b", re.IGNORECASE)
_NO_MEMORY_NVRM = re.compile(
    r"\bout of memory\b|\binsufficient (?:system )?memory\b|(?:\(|status[:= ]\s*)0x0*51\b", re.IGNORECASE
)
_XID = re.compile(r"\bXid\s*\(([^)]*)\)\s*:\s*(\d{1,5})\b")
_NVRM_ERROR_WORDS = re.compile(r"\bNV_ERR_\w+|\bXid\b|\berrors?\b|\bfail(?:ed|ure|s)?\b|\bassert", re.IGNORECASE)
# One line per kill on every kernel since 2.6: "Out of memory: Killed process 123 (python3) ..." (newer)
# or "Killed process 123 (python3) ..." after "Out of memory: Kill process ... or sacrifice child" (older).
_OOM_KILLED = re.compile(r"\bKilled process \d+\b")
_ERR_LEVEL = 3  # syslog: 0 emerg .. 3 err


@dataclass(frozen=True)
class UserPattern:
    name: str
    regex: Searcher  # compiled with RE2 (telemetry.daemon.patterns); anything with .search(text) works


class Classifier:
    def __init__(self, patterns: tuple[UserPattern, ...] = (), *, ignore_test_lines: bool = False) -> None:
        self.patterns = patterns
        self.ignore_test_lines = ignore_test_lines

    def is_ignored(self, record: KmsgRecord) -> bool:
        """A line of memtel's own test suite, while those are ignored."""
        return self.ignore_test_lines and record.message.startswith(TEST_LINE_MARKER)

    def classify(self, record: KmsgRecord) -> list[str]:
        message = record.message
        kinds: list[str] = []
        if self.is_ignored(record):
            return kinds
        is_nvrm = _NVRM.search(message) is not None
        if _NO_MEMORY_NAME.search(message) or (is_nvrm and _NO_MEMORY_NVRM.search(message)):
            kinds.append(NV_ERR_NO_MEMORY)
        if is_nvrm:
            xid = _XID.search(message)
            if xid is not None:
                kinds.append(XID_PREFIX + str(int(xid.group(2))))
            if (
                xid is not None
                or (record.level is not None and record.facility == 0 and record.level <= _ERR_LEVEL)
                or _NVRM_ERROR_WORDS.search(message)
            ):
                kinds.append(NVRM_ERROR)
        elif _OOM_KILLED.search(message):
            kinds.append(OOM_KILL)
        for pattern in self.patterns:
            if pattern.regex.search(message):
                kinds.append(PATTERN_PREFIX + pattern.name)
        return kinds
