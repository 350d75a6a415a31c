"""The daemon's evidence-gated last resort (`protect:` in the daemon config; docs/alerts.md, "Protect").

Off by default, and `dry_run: true` by default. Once a second it takes the node's headroom and MemTotal (and
what starting engines will still take, from the local hook exporters, measured as the headroom is: the free 2 MiB
blocks byte for byte, the rest at the huge-page faults' success ratio); when the headroom is falling for real
by the one definition MemtelUnifiedHeadroomFalling also uses (telemetry.procfs.headroom.FALLING: below a
quarter of MemTotal, a fitted slope steeper than 0.5 GiB/s down over 8 s, at least 4 GiB lost in those 8 s,
and not a start the engines announced that ends above 4 GiB) it runs the configured action once per episode: signal a
process (by pidfile, systemd unit or process-collector role) or run a command (an argument list, no shell).
An episode ends when the condition has been false for `rearm_seconds`. What a hook says a start will still
take is a claim from any process answering on a hook target, so it is range-checked (`start_evidence`): a value
that is not a number is no start, one below 0 counts as 0, one above MemTotal as MemTotal, and a start that
has only ever said 0 (no start at all) explains nothing. A role target (`role:` with `user:`) signals only
processes of the user that runs the engine. Each decision, with its evidence, is one log line, counted in
`memtel_protect_decisions_total{decision}` and kept in the `memtel_protect_last_*` gauges, which the flight
recorder records with every other series.

The config is hostile input: unknown keys, a command given as a string (it would need a shell), a signal
outside a short list, a pidfile that is a symlink or not a regular file, a pid of 1 or of the daemon itself
are refused, at load time where they can be and at action time otherwise (then the decision is "failed").
"""

from __future__ import annotations

import logging
import math
import os
import pwd
import signal
import stat
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from prometheus_client.core import Metric

from telemetry.catalogue.metrics import (
    ENGINE_START_REMAINING,
    PROTECT_DECISIONS,
    PROTECT_DRY_RUN,
    PROTECT_EPISODE_ACTIVE,
    PROTECT_LAST_DECISION_TIMESTAMP,
    PROTECT_LAST_DROP,
    PROTECT_LAST_HEADROOM,
    PROTECT_LAST_SLOPE,
)
from telemetry.flight.hooks import HookScraper
from telemetry.procfs.headroom import FALLING, FallingEvidence, FallingRule, falling_evidence, headroom_taken

log = logging.getLogger("memtel.daemon.protect")

SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGKILL", "SIGUSR1", "SIGUSR2")
TARGET_KINDS = ("pidfile", "unit", "role")
DECISIONS = ("acted", "would_act", "failed")
MAX_COMMAND_ARGS = 64
MAX_ARG_CHARS = 4096
COMMAND_TIMEOUT_S = 30.0
MAX_PIDFILE_BYTES = 64
MAX_ROLE_PROCESSES = 16


class Reading(NamedTuple):
    """One protect sample: the headroom and MemTotal; per starting engine what its start will still take (None or
    empty: none is starting); the headroom without reclaim and the huge-page faults' success ratio (None: no
    evidence), with which a start's bytes are measured as the headroom is (None without reclaim: byte for byte)."""

    headroom: float
    mem_total: float
    start_remaining: Mapping[str, float] | None = None
    without_reclaim: float | None = None
    success_ratio: float | None = None

_UNIT_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789:-_.@\\")


@dataclass(frozen=True)
class ProtectConfig:
    enabled: bool = False
    dry_run: bool = True
    signal: str = "SIGTERM"
    target_kind: str | None = None  # "pidfile", "unit" or "role" when the action is a signal
    target: str | None = None
    user: int | None = None  # with a role target: the uid that runs the engine; other users' processes never match
    command: tuple[str, ...] = ()  # the action when it is a command
    rearm_seconds: float = 60.0
    interval_seconds: float = 1.0

    def describe_action(self) -> str:
        if self.command:
            return "run " + " ".join(self.command)
        owner = "" if self.user is None else f" of uid {self.user}"
        return f"send {self.signal} to {self.target_kind} {self.target}{owner}"


def parse_user(v: Any, value: Any, path: str) -> int:
    """The engine's owner: a user name of this host or a uid."""
    if isinstance(value, int) and not isinstance(value, bool):
        return int(v.integer(value, path, 0, 2**32 - 2))
    name = v.text(value, path, 256)
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        raise v.fail(path, f"no user {name[:64]!r} on this host; expected the user that runs the engine "
                           "(a name or a uid)") from None


def parse_protect(v: Any, value: Any, path: str) -> ProtectConfig:
    """The `protect:` section, checked with the daemon config's validator `v` (telemetry.validate)."""
    data = v.mapping(value, path, (), ("enabled", "dry_run", "signal", "pidfile", "unit", "role", "user", "command",
                                       "rearm_seconds", "interval_seconds"))
    enabled = v.boolean(data.get("enabled", False), f"{path}.enabled")
    dry_run = v.boolean(data.get("dry_run", True), f"{path}.dry_run")
    targets = [kind for kind in TARGET_KINDS if data.get(kind) is not None]
    command_raw = data.get("command")
    if command_raw is not None and targets:
        raise v.fail(path, f"give one action: a command, or a signal to one of {', '.join(TARGET_KINDS)}; "
                           f"got command and {targets[0]}")
    if len(targets) > 1:
        raise v.fail(path, f"give one signal target ({', '.join(TARGET_KINDS)}); got {', '.join(targets)}")
    command: tuple[str, ...] = ()
    if command_raw is not None:
        if isinstance(command_raw, str):
            raise v.fail(f"{path}.command", "expected a list of arguments (argv), e.g. [/usr/bin/systemctl, stop, "
                                            "vllm]; a string would need a shell, which memtel never runs as root")
        if not isinstance(command_raw, list) or not 1 <= len(command_raw) <= MAX_COMMAND_ARGS:
            raise v.fail(f"{path}.command", f"expected a list of 1 to {MAX_COMMAND_ARGS} arguments")
        for i, arg in enumerate(command_raw):
            if not isinstance(arg, str) or not arg or len(arg) > MAX_ARG_CHARS or "\0" in arg:
                raise v.fail(f"{path}.command[{i}]", "expected a non-empty text argument")
        if not os.path.isabs(command_raw[0]):
            raise v.fail(f"{path}.command[0]", f"expected an absolute path to the program, got {command_raw[0]!r} "
                                               "(no PATH lookup as root)")
        command = tuple(command_raw)
    signame = data.get("signal", "SIGTERM")
    if signame not in SIGNALS:
        raise v.fail(f"{path}.signal", f"expected one of {', '.join(SIGNALS)}, got {str(signame)[:40]!r}")
    target_kind = targets[0] if targets else None
    target = None
    if target_kind is not None:
        target = v.text(data[target_kind], f"{path}.{target_kind}", 4096)
        if target_kind == "pidfile" and not os.path.isabs(target):
            raise v.fail(f"{path}.pidfile", f"expected an absolute path, got {target!r}")
        if target_kind == "unit" and (not target or set(target) - _UNIT_CHARS or target.startswith("-")):
            raise v.fail(f"{path}.unit", f"{target[:80]!r} is not a systemd unit name")
    user = None
    if target_kind == "role":
        if data.get("user") is None:
            raise v.fail(f"{path}.user", "a role target needs the user that runs the engine (a name or a uid): "
                                         "processes of other users with the same title are never signalled")
        user = parse_user(v, data["user"], f"{path}.user")
    elif data.get("user") is not None:
        raise v.fail(f"{path}.user", "only a role target takes a user")
    if enabled and not command and target_kind is None:
        raise v.fail(path, f"enabled, but no action: give command (a list) or one of {', '.join(TARGET_KINDS)}")
    return ProtectConfig(
        enabled=enabled, dry_run=dry_run, signal=signame, target_kind=target_kind, target=target, user=user,
        command=command,
        rearm_seconds=v.number(data.get("rearm_seconds", 60.0), f"{path}.rearm_seconds", 1.0, 86400.0),
        interval_seconds=v.number(data.get("interval_seconds", 1.0), f"{path}.interval_seconds", 0.1, 10.0),
    )


# -- the decision ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Decision:
    time: float
    decision: str  # one of DECISIONS
    evidence: FallingEvidence
    detail: str


@dataclass
class Episodes:
    """Feeds (time, headroom, MemTotal) samples through the falling definition; says when to act: once per
    episode, an episode lasting until the condition has been false for `rearm_seconds`."""

    rearm_seconds: float = 60.0
    rule: FallingRule = FALLING
    samples: deque[tuple[float, float, Mapping[str, float]]] = field(default_factory=deque)
    active: bool = False
    last_true: float | None = None
    last_taking: dict[str, float] = field(default_factory=dict)  # per engine, when it last said more than 0

    def observe(self, now: float, headroom: float, mem_total: float,
                start_remaining: Mapping[str, float] | None = None, without_reclaim: float | None = None,
                success_ratio: float | None = None) -> FallingEvidence | None:
        """The evidence if this sample starts an episode (act now), else None. `start_remaining`: per starting
        engine (any key naming it), what its start will still take (its hook's memtel_engine_start_remaining_bytes;
        empty or None: no engine is starting), taken from the headroom as the headroom measures it
        (headroom_taken, with this sample's headroom without reclaim and success ratio; `without_reclaim` None:
        byte for byte)."""
        starts = start_evidence(start_remaining or {}, mem_total, now, self.last_taking)
        if without_reclaim is not None:
            starts = {engine: headroom_taken(remaining, without_reclaim, success_ratio)
                      for engine, remaining in starts.items()}
        self.samples.append((now, headroom, starts))
        keep = self.rule.window_seconds + self.rule.start_lag_seconds  # falling_evidence's history
        while self.samples and self.samples[0][0] < now - keep:
            self.samples.popleft()
        present = {engine for _, _, remaining in self.samples for engine in remaining}
        for engine in [e for e in self.last_taking if e not in present]:
            del self.last_taking[engine]
        evidence = falling_evidence([(t, v) for t, v, _ in self.samples], mem_total, self.rule,
                                    [r for _, _, r in self.samples])
        falling = evidence is not None and evidence.is_falling(self.rule)
        if falling:
            self.last_true = now
            if not self.active:
                self.active = True
                return evidence
        elif self.active and self.last_true is not None and now - self.last_true >= self.rearm_seconds:
            self.active = False
        return None


# -- the action -----------------------------------------------------------------------------------------------
class ActionError(Exception):
    pass


def read_pidfile(path: str) -> int:
    """The pid in a pidfile that is a regular file, not a symlink, owned by root or by the daemon's user."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == 40:  # ELOOP: the last component is a symlink
            raise ActionError(f"pidfile {path} is a symlink; refused") from None
        raise ActionError(f"pidfile {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ActionError(f"pidfile {path} is not a regular file; refused")
        if info.st_uid not in (0, os.geteuid()) or info.st_mode & stat.S_IWOTH:
            raise ActionError(f"pidfile {path} can be written by others (owner uid {info.st_uid}); refused")
        text = os.read(fd, MAX_PIDFILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(text) > MAX_PIDFILE_BYTES or not text.strip().isdigit():
        raise ActionError(f"pidfile {path} does not hold one process id")
    return int(text.strip())


def check_pid(pid: int) -> int:
    if pid <= 1 or pid == os.getpid():
        raise ActionError(f"pid {pid} is init or the daemon itself; refused")
    return pid


def role_pids(role_pattern: Any, uid: int, limit: int = MAX_ROLE_PROCESSES) -> list[int]:
    """The processes of user `uid` (real and effective) whose command line matches the process collector's role
    pattern (telemetry.daemon.collectors.processes). A process title is anyone's to choose, so only the engine's
    owner's processes count, and more than `limit` of them is refused rather than cut short (ActionError)."""
    import psutil

    pids = []
    for process in psutil.process_iter(["pid", "uids", "cmdline"]):
        uids = process.info.get("uids")
        if uids is None or uids.real != uid or uids.effective != uid or process.info["pid"] == os.getpid():
            continue
        cmdline = " ".join(process.info.get("cmdline") or ())
        if cmdline and role_pattern.search(cmdline):
            pids.append(int(process.info["pid"]))
            if len(pids) > limit:
                raise ActionError(f"more than {limit} processes of uid {uid} match the role; refused (a role target "
                                  "signals an engine's processes, not a crowd)")
    return pids


def run_action(config: ProtectConfig, roles: dict[str, Any]) -> str:
    """Do the configured action; what was done, or ActionError."""
    if config.command:
        try:
            result = subprocess.run(list(config.command), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, timeout=COMMAND_TIMEOUT_S, check=False, close_fds=True)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ActionError(f"command {config.command[0]}: {exc}") from None
        if result.returncode != 0:
            tail = result.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
            raise ActionError(f"command {config.command[0]} exited {result.returncode}: {tail[0][:200]}")
        return f"ran {config.command[0]} (exit 0)"
    number = signal.Signals[config.signal]
    assert config.target is not None
    if config.target_kind == "unit":
        command = ["/usr/bin/systemctl", "kill", f"--signal={config.signal}", "--", config.target]
        try:
            result = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, timeout=COMMAND_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ActionError(f"systemctl kill {config.target}: {exc}") from None
        if result.returncode != 0:
            raise ActionError(f"systemctl kill {config.target} exited {result.returncode}")
        return f"sent {config.signal} to unit {config.target}"
    if config.target_kind == "pidfile":
        pids = [check_pid(read_pidfile(config.target))]
    else:
        pattern = roles.get(config.target)
        if pattern is None:
            raise ActionError(f"role {config.target} is not one of the process collector's roles "
                              f"({', '.join(sorted(roles))})")
        if config.user is None:
            raise ActionError(f"role {config.target} has no user (the engine's owner); refused")
        pids = [check_pid(pid) for pid in role_pids(pattern, config.user)]
        if not pids:
            raise ActionError(f"no process of uid {config.user} has role {config.target}")
    for pid in pids:
        try:
            os.kill(pid, number)
        except OSError as exc:
            raise ActionError(f"kill {pid}: {exc.strerror}") from None
    return f"sent {config.signal} to pid {', '.join(map(str, pids))} ({config.target_kind} {config.target})"


# -- the loop and its metrics ---------------------------------------------------------------------------------
class Protect:
    """The protect loop: `sample()` gives (headroom, MemTotal, what starting engines will still take or None) or
    None; `collect()` gives its metrics."""

    def __init__(self, config: ProtectConfig, sample: Callable[[], Reading | None],
                 roles: dict[str, Any] | None = None, clock: Callable[[], float] = time.time,
                 action: Callable[[ProtectConfig, dict[str, Any]], str] = run_action) -> None:
        self.config = config
        self.sample = sample
        self.roles = roles or {}
        self.clock = clock
        self.action = action
        self.episodes = Episodes(config.rearm_seconds)
        self.counts = dict.fromkeys(DECISIONS, 0)
        self.last: Decision | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.starts: HookScraper | None = None  # the local hook exporters' engine-start series (cli.build_protect)

    def step(self) -> Decision | None:
        """One sample through the definition; the decision it led to, if any."""
        reading = self.sample()
        if reading is None:
            return None
        now = self.clock()
        evidence = self.episodes.observe(now, *reading)
        if evidence is None:
            return None
        if self.config.dry_run:
            decision = Decision(now, "would_act", evidence, f"dry run: would {self.config.describe_action()}")
        else:
            try:
                decision = Decision(now, "acted", evidence, self.action(self.config, self.roles))
            except ActionError as exc:
                decision = Decision(now, "failed", evidence, str(exc))
        with self._lock:
            self.counts[decision.decision] += 1
            self.last = decision
        level = logging.ERROR if decision.decision == "failed" else logging.WARNING
        slope = evidence.slope_bytes_per_second or 0.0
        starts = ("no engine starting" if evidence.after_starts_bytes is None else
                  f"{evidence.after_starts_bytes / 2**30:.2f} GiB once the starting engines hold their plan")
        log.log(level, "protect %s: %s; headroom %.2f GiB of %.1f GiB, falling %.2f GiB/s, %.2f GiB lost in %g s "
                "(%d samples), %s", decision.decision, decision.detail, evidence.headroom_bytes / 2**30,
                evidence.mem_total_bytes / 2**30, -slope / 2**30, evidence.drop_bytes / 2**30,
                self.episodes.rule.window_seconds, evidence.samples, starts)
        return decision

    def start(self) -> None:
        if self.starts is not None:
            self.starts.start()

        def loop() -> None:
            while not self._stop.wait(self.config.interval_seconds):
                try:
                    self.step()
                except Exception as exc:  # the last resort must never take the daemon down
                    log.warning("protect: a step failed: %s: %s", type(exc).__name__, exc)

        self._thread = threading.Thread(target=loop, name="memtel-protect", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.starts is not None:
            self.starts.stop()

    def collect(self) -> list[Metric]:
        with self._lock:
            counts, last = dict(self.counts), self.last
        decisions = PROTECT_DECISIONS.new()
        for name in DECISIONS:
            decisions.add_metric([name], counts[name])
        families = [decisions, PROTECT_DRY_RUN.new(1.0 if self.config.dry_run else 0.0),
                    PROTECT_EPISODE_ACTIVE.new(1.0 if self.episodes.active else 0.0)]
        if last is not None:
            families += [PROTECT_LAST_DECISION_TIMESTAMP.new(last.time),
                         PROTECT_LAST_HEADROOM.new(last.evidence.headroom_bytes),
                         PROTECT_LAST_SLOPE.new(last.evidence.slope_bytes_per_second or 0.0),
                         PROTECT_LAST_DROP.new(last.evidence.drop_bytes)]
        return families


def start_remaining_bytes(hook_values: Mapping[str, float], mem_total: float | None = None) -> dict[str, float]:
    """Per starting engine (its series key), what its start will still take: the hook exporters' last values of
    memtel_engine_start_remaining_bytes, within 0 and `mem_total` (`bounded_remaining`); empty when no engine is
    starting."""
    prefix = ENGINE_START_REMAINING.series + "{"
    starts = {}
    for key, value in hook_values.items():
        if key.startswith(prefix) and (bounded := bounded_remaining(value, mem_total)) is not None:
            starts[key] = bounded
    return starts


def bounded_remaining(value: float, mem_total: float | None) -> float | None:
    """One engine's claim of what its start will still take, range-checked: None if it is no number (no start),
    else within 0 (a start gives nothing back: a negative claim would explain any fall) and MemTotal (no start
    takes more than the node has; a larger claim only makes a fall less explained)."""
    if not isinstance(value, (int, float)) or math.isnan(value):
        return None
    value = max(float(value), 0.0)
    return min(value, float(mem_total)) if mem_total is not None and math.isfinite(mem_total) else value


def start_evidence(start_remaining: Mapping[str, float], mem_total: float, now: float,
                   last_taking: dict[str, float]) -> dict[str, float]:
    """The starts of one sample that count as evidence: each value bounded (`bounded_remaining`), and a start at
    0 only once that engine has said more than 0 (a start that took its plan): a start that has only ever said 0
    (one answering on a hook target without starting anything) takes nothing and explains no fall. `last_taking`
    (per engine, when it last said more than 0; Episodes forgets an engine gone longer than its history) is
    updated."""
    starts = {}
    for engine, value in start_remaining.items():
        bounded = bounded_remaining(value, mem_total)
        if bounded is None:
            continue
        if bounded > 0:
            last_taking[engine] = now
        elif engine not in last_taking:
            continue
        starts[engine] = bounded
    return starts
