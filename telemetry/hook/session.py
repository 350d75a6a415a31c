"""install / uninstall: one hook session per process.

The session owns the patches, the import watcher (targets whose module is not imported yet), the
recorder and its sinks. Installing again adds only targets that are not hooked yet (installing the
same target twice is a no-op) and returns the same handle; `uninstall()` puts back the original
objects and stops the sinks.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from telemetry.hook import presets
from telemetry.hook.jsonl_sink import JsonlConfig, JsonlSink
from telemetry.hook.prometheus_sink import Exporter, HookCollector, HookStats
from telemetry.hook.record import Recorder, make_wrapper
from telemetry.hook.targets import (
    ImportWatcher,
    InstallError,
    Patch,
    Target,
    apply_patch,
    module_exists,
    parse_target,
)

log = logging.getLogger("memtel.hook")

DEFAULT_PORT = 9200


@dataclass(frozen=True)
class HookConfig:
    port: int | None = DEFAULT_PORT   # exporter on port + local rank; None: no exporter
    addr: str = "0.0.0.0"
    log_dir: str | None = None        # per-call JSONL log; None: no log
    record_shape: bool = False           # add [rows, cols] of the first tensor argument
    flush_interval_s: float = 0.5
    flush_records: int = 4096
    max_queue: int = 65536

    def __post_init__(self) -> None:
        if self.port is not None and (isinstance(self.port, bool) or not isinstance(self.port, int)
                                      or not 0 < self.port < 65536):
            raise ValueError(f"port must be an integer in 1..65535 (or None for no exporter), got {self.port!r}")
        if self.flush_interval_s <= 0 or self.flush_records < 1 or self.max_queue < 1:
            raise ValueError("flush_interval_s, flush_records and max_queue must be positive")


def parse_targets(targets: str | Iterable[str]) -> list[Target]:
    """Targets and preset names (a comma-separated string or a list) -> targets; ValueError if malformed."""
    items = targets.split(",") if isinstance(targets, str) else list(targets)
    names = [item.strip() if isinstance(item, str) else item for item in items]
    names = [n for n in names if n != ""]
    if not names:
        raise ValueError(f"no hook targets given: expected one or more of "
                         f'"package.module:function", "package.module:Class.method" or a preset '
                         f"({', '.join(sorted(presets.PRESETS))})")
    for name in names:
        if isinstance(name, str) and ":" not in name and name not in presets.PRESETS:
            raise ValueError(f"unknown hook target or preset {name!r}: expected "
                             f'"package.module:function", "package.module:Class.method" or one of the '
                             f"presets {', '.join(sorted(presets.PRESETS))}")
    return [parse_target(t) for t in presets.expand(names)]


class HookHandle:
    """What `install` returns: the state of this process's hook and `uninstall()`."""

    def __init__(self, session: HookSession) -> None:
        self._session = session

    @property
    def installed(self) -> list[str]:
        return [t.name for t in self._session.patches]

    @property
    def pending(self) -> list[str]:
        return [t.name for t in self._session.pending]

    @property
    def failed(self) -> dict[str, str]:
        return dict(self._session.failed)

    @property
    def stats(self) -> HookStats:
        return self._session.stats

    @property
    def collector(self) -> HookCollector:
        return self._session.collector

    @property
    def log_path(self) -> str | None:
        jsonl = self._session.recorder.jsonl
        return jsonl.path if jsonl is not None else None

    @property
    def exporter_port(self) -> int | None:
        exporter = self._session.recorder.exporter
        return exporter.port if exporter is not None else None

    def flush(self) -> None:
        self._session.flush()

    def uninstall(self) -> None:
        self._session.close()

    @property
    def active(self) -> bool:
        return not self._session.closed


class HookSession:
    def __init__(self, config: HookConfig, registry=None) -> None:
        self.config = config
        self.closed = False
        self.lock = threading.RLock()
        self.patches: dict[Target, Patch] = {}
        self.pending: dict[Target, None] = {}
        self.failed: dict[str, str] = {}
        self.stats = HookStats()
        jsonl = None
        if config.log_dir is not None:
            jsonl = JsonlSink(JsonlConfig(config.log_dir, config.max_queue, config.flush_records,
                                          config.flush_interval_s), node="",
                              on_error=lambda stage: self.stats.count_error("", stage))
        self.recorder = Recorder(exporter=None, jsonl=jsonl, stats=self.stats,
                                 record_shape=config.record_shape, on_first_record=self._first_record)
        self.collector = HookCollector(self.stats, self.recorder.labels)
        if config.port is not None:
            self.recorder.exporter = Exporter(self.collector, config.port, config.addr)
        if jsonl is not None:
            jsonl.node = self.recorder.node
        self.registry = registry
        if registry is not None:
            registry.register(self.collector)
        self.wrap = make_wrapper(self.recorder.record)
        self.watcher = ImportWatcher(self._module_loaded, self._module_missing)
        self._previous_sigterm = None
        self._sigterm_installed = False
        self.handle = HookHandle(self)
        self.recorder.baseline()
        atexit.register(self.close)

    # targets
    def add(self, targets: list[Target]) -> None:
        with self.lock:
            for target in targets:
                if target in self.patches or target in self.pending:
                    continue  # installing twice is a no-op
                self.failed.pop(target.name, None)
                module = sys.modules.get(target.module)
                if module is not None:
                    self._patch(target, module)
                    continue
                if module_exists(target.module) is False:
                    self._fail(target, "module_not_found", f"{target}: no module named {target.module!r}")
                    continue
                self.pending[target] = None
                self.watcher.watch(target.module)

    def _patch(self, target: Target, module) -> None:
        try:
            self.patches[target] = apply_patch(target, module, self.wrap)
        except InstallError as error:
            self._fail(target, error.reason, str(error))
        except Exception as error:  # an odd module or descriptor: never crash the host
            self._fail(target, "patch_failed", f"{target}: {error!r}")

    def _fail(self, target: Target, reason: str, message: str) -> None:
        self.failed[target.name] = reason
        self.stats.count_install_failure(target.name, reason)
        log.warning("memtel: hook target not installed (%s): %s", reason, message)

    def _module_loaded(self, name: str) -> None:
        with self.lock:
            if self.closed:
                return
            module = sys.modules.get(name)
            for target in [t for t in self.pending if t.module == name]:
                del self.pending[target]
                if module is not None:
                    self._patch(target, module)
            self.watcher.unwatch(name)

    def _module_missing(self, name: str) -> None:
        with self.lock:
            for target in [t for t in self.pending if t.module == name]:
                del self.pending[target]
                self._fail(target, "module_not_found", f"{target}: no module named {name!r}")
            self.watcher.unwatch(name)

    # first record of this process: flush the log on SIGTERM too (only where something records)
    def _first_record(self) -> None:
        if self.recorder.jsonl is None:
            return
        # A multiprocessing child (vLLM's workers) ends with os._exit: atexit never runs there, the
        # multiprocessing finalizers do. Only if the process uses multiprocessing already.
        mp_util = sys.modules.get("multiprocessing.util")
        if mp_util is not None:
            try:
                mp_util.Finalize(None, self.flush, exitpriority=0)
            except Exception:
                pass
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            previous = signal.getsignal(signal.SIGTERM)
            if previous == self._on_sigterm:  # a forked child inherits ours: do not chain to itself
                return
            self._previous_sigterm = previous
            signal.signal(signal.SIGTERM, self._on_sigterm)
            self._sigterm_installed = True
        except (ValueError, OSError):  # not the main thread of the main interpreter
            pass

    def _on_sigterm(self, signum, frame):
        try:
            self.flush()
        except Exception:
            pass
        previous = self._previous_sigterm
        if callable(previous):
            return previous(signum, frame)
        if previous == signal.SIG_IGN:
            return None
        # The default action (or one set outside Python): terminate the way it would have.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return None

    def flush(self) -> None:
        if self.recorder.jsonl is not None:
            self.recorder.jsonl.flush()

    def close(self) -> None:
        global _session
        with self.lock:
            if self.closed:
                return
            self.closed = True
            for patch in reversed(list(self.patches.values())):
                patch.restore()
            self.patches.clear()
            self.pending.clear()
            self.watcher.close()
        self.recorder.close()
        if self.registry is not None:
            try:
                self.registry.unregister(self.collector)
            except KeyError:
                pass
        if self._sigterm_installed and threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                    signal.signal(signal.SIGTERM, self._previous_sigterm
                                  if self._previous_sigterm is not None else signal.SIG_DFL)
            except (ValueError, OSError):
                pass
        atexit.unregister(self.close)
        with _lock:
            if _session is self:
                _session = None

    def after_fork_in_child(self) -> None:
        self.lock = threading.RLock()
        self._sigterm_installed = False
        self.recorder.reset_after_fork()


_lock = threading.Lock()
_session: HookSession | None = None


def install(targets: str | Iterable[str], *, port: int | None = DEFAULT_PORT, log_dir: str | None = None,
            record_shape: bool = False, addr: str = "0.0.0.0", registry=None,
            flush_interval_s: float = 0.5, flush_records: int = 4096, max_queue: int = 65536) -> HookHandle:
    """Hook `targets` in this process and return the handle (see docs/hook.md).

    `targets`: "package.module:function", "package.module:Class.method" or preset names, as a list
    or one comma-separated string. A malformed target raises ValueError; a module or attribute
    that does not exist is logged and counted (memtel_hook_install_failures_total), never raised.
    `port`: the exporter listens on port + local rank once a hooked function has run here (None: no
    exporter). `log_dir`: per-call JSONL log directory (None: no log). `registry`: also register
    the hook's collector there (tests).
    """
    global _session
    parsed = parse_targets(targets)
    config = HookConfig(port=port, addr=addr, log_dir=None if log_dir is None else os.fspath(log_dir),
                        record_shape=record_shape, flush_interval_s=flush_interval_s,
                        flush_records=flush_records, max_queue=max_queue)
    with _lock:
        session = _session
        if session is None:
            session = _session = HookSession(config, registry)
        elif session.config != config:
            log.warning("memtel: hook already installed in this process with other options; "
                        "keeping %s, adding targets only", session.config)
    session.add(parsed)
    return session.handle


def active_handle() -> HookHandle | None:
    session = _session
    return session.handle if session is not None else None


def _after_fork_in_child() -> None:
    if _session is not None:
        _session.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
