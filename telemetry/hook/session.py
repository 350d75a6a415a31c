"""install / uninstall: one hook session per process, built from one HookConfig.

The session builds its parts in dependency order, each from the config and the parts before it: the
state, the call-log writer, the recorder (the hot path), the collector and the registry the exporter
serves. It owns the patches and the import watcher (targets whose module is not imported yet). A
process "starts" at its first record, or at the unresolved check: the rank is resolved, the call log
opened, the exporter started, and the hook announces itself once through the `memtel.hook` logger.

Installing again adds only targets that are not hooked yet (installing the same target twice is a
no-op) and returns the same handle; `uninstall()` puts back the original objects and stops the rest.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterable
from types import FrameType, ModuleType
from typing import Any

from prometheus_client.registry import CollectorRegistry

from telemetry import hook_env
from telemetry.catalogue import metrics as catalogue
from telemetry.errors import ConfigError
from telemetry.hook import allocator, passthrough, presets
from telemetry.hook.collector import HookCollector
from telemetry.hook.config import HookConfig
from telemetry.hook.engine import EngineCollector, EngineTracker
from telemetry.hook.exporter import ExporterHandle, start_exporter
from telemetry.hook.forecast.collector import ForecastCollector
from telemetry.hook.forecast.runner import Forecaster
from telemetry.hook.log_writer import CallLogWriter
from telemetry.hook.rank import RankInfo, resolve_rank
from telemetry.hook.record import Recorder
from telemetry.hook.state import INSTALLED, NOT_IN_MODEL, PENDING, HookState
from telemetry.hook.targets import (
    WRAPPED_ATTR,
    ImportWatcher,
    InstallError,
    Patch,
    Target,
    apply_patch,
    module_exists,
    parse_target,
)
from telemetry.procfs.meminfo import MeminfoReader

log = logging.getLogger("memtel.hook")

# How an unresolved target's status reads in the log.
_UNRESOLVED_WHY = {
    PENDING: "its module was never imported",
    "module_not_found": "no such module",
    "attribute_not_found": "no such function or method",
    "not_callable": "not callable",
    "patch_failed": "could not be patched",
}

Wrapper = Callable[[Callable[..., Any], Target], Callable[..., Any]]
MODULE_NOT_FOUND = "module_not_found"


def exporter_where(scheme: str, addr: str, port: int) -> str:
    """The announcement's exporter URL; one that listens on every interface says so and how to restrict it."""
    from telemetry.exporter.address import format_listen  # loaded with the exporter, not before

    where = f"{scheme}://{format_listen(addr, port)}/metrics"
    if addr in ("0.0.0.0", "::", ""):
        where += (f" (every interface: {hook_env.ADDR}=127.0.0.1, or `memtel run --addr 127.0.0.1`, keeps it on "
                  "this machine)")
    return where


def _why(target: str, status: str) -> str:
    if status == NOT_IN_MODEL:
        names = [layer.partition(":")[2] for layer in presets.LAYERS[target]]
        layers = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        return f"hooked, but the loaded model has no {layers} layer: it never runs"
    return _UNRESOLVED_WHY.get(status, status)


class HookHandle:
    """What `install` returns: the state of this process's hook and `uninstall()`."""

    def __init__(self, session: HookSession) -> None:
        self._session = session

    @property
    def config(self) -> HookConfig:
        return self._session.config

    @property
    def installed(self) -> list[str]:
        return [t.name for t in self._session.patches if t not in self._session.signals]

    @property
    def pending(self) -> list[str]:
        """Targets waiting for their module's import (those whose module cannot be found now are in `failed`)."""
        targets = self._session.state.targets
        return [t.name for t in self._session.pending
                if t not in self._session.signals and targets.get(t.name, PENDING) == PENDING]

    @property
    def failed(self) -> dict[str, str]:
        return {name: status for name, status in self.unresolved.items() if status not in (PENDING, NOT_IN_MODEL)}

    @property
    def unresolved(self) -> dict[str, str]:
        """Configured targets not installed now: name -> "pending" or the reason it failed."""
        return self._session.state.unresolved()

    @property
    def state(self) -> HookState:
        return self._session.state

    @property
    def collector(self) -> HookCollector:
        return self._session.collector

    @property
    def forecaster(self) -> Forecaster | None:
        """The live forecast of this process (None: MEMTEL_FORECAST_TOKENS not set)."""
        return self._session.forecaster

    @property
    def log_path(self) -> str | None:
        writer = self._session.recorder.log
        return writer.path if writer is not None else None

    @property
    def exporter_port(self) -> int | None:
        exporter = self._session.exporter
        return exporter.port if exporter is not None else None

    def check_unresolved(self, when: str = "when asked", *, start: bool = True) -> dict[str, str]:
        """Report the targets not resolved now, once (a warning and memtel_hook_unresolved_targets), and start
        this process's exporter and log: what the model-loaded signal or the timer does. Returns them.
        `when` completes the warning ("... not resolved <when> in pid N"); `start=False`: the warning only
        (the process starts later, at its first hooked call, if ever)."""
        return self._session.check_unresolved(when, start=start)

    def flush(self) -> None:
        """Write every waiting call-log record now. Never raises (a failed write is counted and logged)."""
        self._session.flush()

    def uninstall(self) -> None:
        self._session.close()

    @property
    def active(self) -> bool:
        return not self._session.closed


class HookSession:
    def __init__(self, config: HookConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.closed = False
        self.lock = threading.RLock()
        self._start_lock = threading.Lock()
        self._unannounced: RankInfo | None = None  # started, not announced yet (start_process)
        self.patches: dict[Target, Patch] = {}
        self.pending: dict[Target, Wrapper] = {}
        self.signals: set[Target] = set()   # model-loaded and engine-memory targets: patched, not hook targets
        self.state = HookState(node=config.node or socket.gethostname(), targets={},
                               log_configured=config.log_dir is not None)
        self.log = (CallLogWriter(config.log_dir, self.state, max_queue=config.max_queue,
                                  flush_records=config.flush_records, flush_interval_s=config.flush_interval_s)
                    if config.log_dir is not None else None)
        self.recorder = Recorder(self.state, self.log, MeminfoReader(config.meminfo_path),
                                 record_shape=config.record_shape, on_first_record=self.start_process)
        self.collector = HookCollector(self.state)
        self.registry = CollectorRegistry(auto_describe=True)   # what the exporter serves
        self.registry.register(self.collector)
        self.extra_registry = registry
        if registry is not None:
            registry.register(self.collector)
        self.engine = EngineTracker()     # the engine's weights, KV cache and graph pools (telemetry/hook/engine.py)
        self.engine_collector = EngineCollector(self.engine, self.state)
        self.registry.register(self.engine_collector)
        if registry is not None:
            registry.register(self.engine_collector)
        self.forecaster: Forecaster | None = None
        self._model_loaded_seen = False
        if config.forecast_tokens:
            self.forecaster = Forecaster(config.forecast_tokens, config.forecast_interval_s,
                                         config_workload=config.forecast_shape,
                                         waiting_for_model=self._waiting_for_model)
            self.forecast_collector = ForecastCollector(self.forecaster, self.state)
            self.registry.register(self.forecast_collector)
            if registry is not None:
                registry.register(self.forecast_collector)
        self.exporter: ExporterHandle | None = None
        self.wrap = self.recorder.wrap
        self.signal_wrap = _make_signal_wrapper(self._model_loaded)
        self.engine_wrap = _make_signal_wrapper(self._engine_memory)
        self.watcher = ImportWatcher(self._module_loaded, self._module_missing)
        self._previous_sigterm: Any = None
        self._sigterm_installed = False
        self._timer: threading.Timer | None = None
        self.handle = HookHandle(self)
        self.recorder.baseline()
        self._model_signals = frozenset(parse_target(name) for name in config.model_loaded)
        self._add([parse_target(name) for name in config.model_loaded], self.signal_wrap)
        self._add([parse_target(name) for name in config.engine_memory], self.engine_wrap)
        if config.unresolved_after_s is not None:
            self._timer = threading.Timer(config.unresolved_after_s, self.check_unresolved,
                                          args=(f"{config.unresolved_after_s:g} s after install",))
            self._timer.daemon = True
            self._timer.name = "memtel-unresolved-check"
            self._timer.start()
        atexit.register(self._at_exit)

    # targets
    def add(self, targets: Iterable[Target]) -> None:
        self._add(list(targets), self.wrap)

    def _add(self, targets: list[Target], wrap: Wrapper) -> None:
        with self.lock:
            for target in targets:
                if target in self.patches or target in self.pending:
                    continue  # installing twice is a no-op
                if wrap is self.signal_wrap or wrap is self.engine_wrap:
                    self.signals.add(target)
                else:
                    self.state.set_target(target.name, PENDING)
                module = sys.modules.get(target.module)
                if module is not None:
                    self._patch(target, module, wrap)
                elif target in self.signals and module_exists(target.module) is False:
                    self._fail(target, MODULE_NOT_FOUND, f"{target}: no module named {target.module!r}")
                else:
                    # Watched even where it cannot be found now: sys.path changes after start-up (the script's
                    # folder, `python -m`'s working directory, a sys.path.insert). Judged at the checks and at exit.
                    self.pending[target] = wrap
                    self.watcher.watch(target.module)
                    if target not in self.signals and module_exists(target.module) is False:
                        self.state.set_target(target.name, MODULE_NOT_FOUND)

    def _patch(self, target: Target, module: ModuleType, wrap: Wrapper) -> None:
        try:
            self.patches[target] = apply_patch(target, module, wrap)
        except InstallError as error:
            self._fail(target, error.reason, str(error))
            return
        except Exception as error:  # an odd module or descriptor: never crash the host
            self._fail(target, "patch_failed", f"{target}: {error!r}")
            return
        if target not in self.signals:
            self.state.set_target(target.name, INSTALLED)

    def _fail(self, target: Target, reason: str, message: str) -> None:
        if target in self.signals:  # another engine or version: the timer (if any) is the fallback
            log.debug("memtel: model-loaded signal %s not available (%s)", target, reason)
            return
        self.state.count_install_failure(target.name, reason)
        log.warning("memtel: hook target not installed (%s): %s", reason, message)

    def _module_loaded(self, name: str) -> None:
        with self.lock:
            if self.closed:
                return
            module = sys.modules.get(name)
            for target in [t for t in self.pending if t.module == name]:
                wrap = self.pending.pop(target)
                if module is not None:
                    self._patch(target, module, wrap)
            self.watcher.unwatch(name)

    def _module_missing(self, name: str) -> None:
        """`name`'s parent package was imported and `name` cannot be found now: a hook target stays watched (it
        may still come, e.g. from an extended package path) and reads as not found until it does."""
        with self.lock:
            for target in [t for t in self.pending if t.module == name]:
                if target in self.signals:
                    del self.pending[target]
                    self._fail(target, MODULE_NOT_FOUND, f"{target}: no module named {name!r}")
                else:
                    self.state.set_target(target.name, MODULE_NOT_FOUND)
            if not any(t.module == name for t in self.pending):
                self.watcher.unwatch(name)

    def _judge_pending(self) -> None:
        """The status of each hook target whose module is not imported, on sys.path as it is now."""
        with self.lock:
            waiting = [t for t in self.pending if t not in self.signals]
        for target in waiting:
            self.state.set_target(target.name, MODULE_NOT_FOUND if module_exists(target.module) is False else PENDING)

    def _at_exit(self) -> None:
        """A target whose module was never imported and cannot be found is a failure, said once, at exit."""
        if not self.closed:
            self._judge_pending()
            with self.lock:
                missing = [t for t in self.pending if t not in self.signals
                           and self.state.targets.get(t.name) == MODULE_NOT_FOUND]
            for target in missing:
                self._fail(target, MODULE_NOT_FOUND, f"{target}: no module named {target.module!r} was found or "
                                                     f"imported by the exit of pid {os.getpid()}")
        self.close()

    # the process: rank, log, exporter, announcement (once, at the first record or the unresolved check)
    def start_process(self, *, announce: bool = True) -> None:
        """Start the process's telemetry once. `announce=False` (an engine's start began: its exporter must be up)
        leaves the announcement to the next call, once the model's targets have had their chance to resolve."""
        with self._start_lock:
            state = self.state
            if self.closed:
                return
            if not state.started:
                rank = resolve_rank(start=True)
                with state.lock:
                    state.rank = rank
                    state.started = True
                if self.log is not None and not self.log.open(rank.rank):
                    self.recorder.log = None
                self._start_exporter(rank)
                if self.forecaster is not None:
                    self.forecaster.start()
                if self.recorder.log is not None:
                    self._flush_at_exit()
                self._unannounced = rank
            if not announce or self._unannounced is None:
                return
            rank, self._unannounced = self._unannounced, None
            self._announce(rank)
        if self.config.unresolved_at_first_call and not self.state.unresolved_checked:
            self.check_unresolved("at this process's first hooked call")

    def _start_exporter(self, rank: RankInfo) -> None:
        config = self.config
        if config.port is None:
            return
        port = config.port + rank.local_rank
        try:
            if not 0 < port < 65536:
                raise ConfigError(f"port {config.port} + local rank {rank.local_rank} = {port} is not a valid port")
            self.exporter = start_exporter(self.registry, config.addr, port, config.web_config)
        except Exception as error:  # a taken port or a bad web config must not stop the log or the host
            log.warning(f"memtel: hook exporter not started on %s port %d ({hook_env.PORT} %d + local rank %d): %s",
                        config.addr, port, config.port, rank.local_rank, error)
            self.state.count_error("", "exporter")

    def _announce(self, rank: RankInfo) -> None:
        hooked = sorted(name for name, status in self.state.targets.items() if status == INSTALLED)
        unresolved = self.state.unresolved()
        if self.exporter is not None:
            exporter = exporter_where(self.exporter.url.partition("://")[0], self.config.addr, self.exporter.port)
        else:
            exporter = (f"off (no port: {hook_env.PORT}=off)" if self.config.port is None
                        else "not started (see the line above)")
        if self.recorder.log is not None and self.recorder.log.path is not None:
            call_log = self.recorder.log.path
        else:
            call_log = (f"off (no log directory: {hook_env.LOG_DIR} unset)" if self.log is None
                        else "off (see the line above)")
        forecast = (f"off (no lengths: {hook_env.FORECAST_TOKENS})" if self.forecaster is None
                    else self.forecaster.describe())
        log.info("memtel hook on in pid %d: rank %d (local rank %d, from %s); hooked: %s; unresolved: %s; "
                 "exporter: %s; call log: %s; forecast: %s", os.getpid(), rank.rank, rank.local_rank, rank.source,
                 ", ".join(hooked) or "none", ", ".join(sorted(unresolved)) or "none", exporter, call_log, forecast)

    def _model_loaded(self, loaded: Target, args: tuple[Any, ...]) -> None:
        """A model-loaded signal returned: `args[0]` is the engine's worker; its `get_model()` (vLLM) or its
        `model` attribute (SGLang's ModelRunner) is the model."""
        worker = args[0] if args else None
        get_model = getattr(worker, "get_model", None)
        try:
            model = get_model() if callable(get_model) else getattr(worker, "model", None)
            if model is not None:
                self._mark_targets_not_in_model(model)
        except Exception as error:  # another engine's worker: the install status alone is reported
            log.debug("memtel: cannot look into the loaded model: %r", error)
        self.engine.model_loaded(worker)
        self._model_loaded_seen = True
        if self.forecaster is not None:
            self.forecaster.model_loaded(worker)   # the engine's indexer workload, before the announcement
        self.check_unresolved("after the model loaded")

    def _engine_memory(self, signal: Target, args: tuple[Any, ...]) -> None:
        """An engine-memory signal returned (the start began, KV cache allocated, graphs captured): `args[0]` is
        the worker. The process starts (exporter up) here too, so a start is exported from its beginning."""
        self.engine.engine_signal(args[0] if args else None, signal.qualname)
        self.start_process(announce=False)

    def _waiting_for_model(self) -> bool:
        """A model-loaded signal is patched (its engine's worker module is imported: this process is an engine's
        worker) and has not fired: the engine's workload is not known yet."""
        if self._model_loaded_seen:
            return False
        with self.lock:
            return any(t in self.patches for t in self._model_signals)

    def _mark_targets_not_in_model(self, model: Any) -> None:
        """Installed targets whose preset layer (presets.LAYERS) the model does not contain: NOT_IN_MODEL."""
        modules = getattr(model, "modules", None)
        if not callable(modules):
            return
        with self.state.lock:
            layers = {name: presets.LAYERS[name] for name, status in self.state.targets.items()
                      if status == INSTALLED and name in presets.LAYERS and name not in self.state.sites}
        classes: dict[str, type] = {}
        for layer in {layer for names in layers.values() for layer in names}:
            module, _, qualname = layer.partition(":")
            cls = getattr(sys.modules.get(module), qualname, None)
            if isinstance(cls, type):   # a layer class whose module was never imported has no instance
                classes[layer] = cls
        found = {layer for module in modules() for layer, cls in classes.items() if isinstance(module, cls)}
        with self.state.lock:
            for name, names in layers.items():
                if (found.isdisjoint(names) and self.state.targets.get(name) == INSTALLED
                        and name not in self.state.sites):
                    self.state.targets[name] = NOT_IN_MODEL

    def check_unresolved(self, when: str, *, start: bool = True) -> dict[str, str]:
        """Warn once about configured targets that are not installed, then start the process (exporter up, so
        memtel_hook_unresolved_targets can be scraped even where nothing was ever recorded) unless `start`
        is False."""
        with self.lock:
            if self.closed:
                return {}
            first = not self.state.unresolved_checked
            with self.state.lock:
                self.state.unresolved_checked = True
        self._judge_pending()
        unresolved = self.state.unresolved()
        if first and unresolved:
            details = "; ".join(f"{name} ({_why(name, status)})" for name, status in sorted(unresolved.items()))
            log.warning("memtel: %d of %d hook targets not resolved %s in pid %d, nothing is recorded for them: %s. "
                        "Check the names against this program's version (docs/hook.md, \"Unresolved targets\")%s",
                        len(unresolved), len(self.state.targets), when, os.getpid(), details,
                        f"; {catalogue.HOOK_UNRESOLVED_TARGETS.series} shows them" if start else "")
        if start:
            self.start_process()
        return unresolved

    # flushing the log on SIGTERM and at a multiprocessing child's exit (only where something records)
    def _flush_at_exit(self) -> None:
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

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> Any:
        writer = self.recorder.log
        if writer is None:
            return self._previous_sigterm_action(signum, frame)
        return writer.flush_then(lambda: self._previous_sigterm_action(signum, frame))

    def _previous_sigterm_action(self, signum: int, frame: FrameType | None) -> Any:
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
        writer = self.recorder.log
        if writer is not None:
            writer.flush()

    def close(self) -> None:
        global _session
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if self._timer is not None:
                self._timer.cancel()
            for patch in reversed(list(self.patches.values())):
                patch.restore()
            self.patches.clear()
            self.pending.clear()
            self.watcher.close()
        if self.forecaster is not None:
            self.forecaster.stop()
        self.recorder.close()
        if self.log is not None:
            self.log.close()
        if self.exporter is not None:
            try:
                self.exporter.stop()
            except Exception:
                pass
            self.exporter = None
        if self.extra_registry is not None:
            for collector in (self.collector, getattr(self, "forecast_collector", None)):
                try:
                    if collector is not None:
                        self.extra_registry.unregister(collector)
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
        """A forked child is a new process: its own numbers, rank, exporter and log. The unresolved timer is
        not re-armed (a pool worker must not start an exporter); the model-loaded signal still works."""
        self.lock = threading.RLock()
        self._start_lock = threading.Lock()
        self._unannounced = None
        self._sigterm_installed = False
        self._timer = None
        self.state.reset_after_fork()
        allocator.current_reader().reset()
        if self.forecaster is not None:
            self.forecaster.reset_after_fork()
        passthrough.reset()   # (the meminfo descriptor is dropped by procfile's own at-fork handler)
        if self.exporter is not None:
            self.exporter.close_after_fork()
            self.exporter = None
        if self.log is not None:
            self.log.reset_after_fork()
        self.recorder.log = self.log


def _make_signal_wrapper(on_return: Callable[[Target, tuple[Any, ...]], None]) -> Wrapper:
    """A factory for targets.apply_patch: the wrapper calls the original, then `on_return(target, args)`
    (never raising into the host)."""

    def wrap(original: Callable[..., Any], target: Target) -> Callable[..., Any]:
        @functools.wraps(original)
        def memtel_model_loaded(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            try:
                on_return(target, args)
            except Exception:
                pass
            return result

        setattr(memtel_model_loaded, WRAPPED_ATTR, original)
        return memtel_model_loaded

    return wrap


_lock = threading.Lock()
_session: HookSession | None = None


def install_config(config: HookConfig, *, registry: CollectorRegistry | None = None) -> HookHandle:
    """Hook `config.targets` in this process with `config`'s settings and return the handle."""
    global _session
    with _lock:
        session = _session
        if session is None:
            session = _session = HookSession(config, registry)
        elif session.config.options() != config.options():
            log.warning("memtel: hook already installed in this process with other options; "
                        "keeping %s, adding targets only", session.config.options())
    session.add(parse_target(name) for name in config.targets)
    return session.handle


def install(targets: str | Iterable[str], *, registry: CollectorRegistry | None = None,
            **options: Any) -> HookHandle:
    """Hook `targets` in this process and return the handle (see docs/hook.md).

    `targets`: "package.module:function", "package.module:Class.method" or preset names, as a list
    or one comma-separated string. `options`: the HookConfig settings (port, addr, log_dir,
    record_shape, ...). A malformed target or option raises ConfigError (a ValueError); a module or
    attribute that does not exist is logged and counted (memtel_hook_install_failures_total), never raised.
    `registry`: also register the hook's collector there (tests).
    """
    try:
        config = HookConfig(targets=targets, **options)  # type: ignore[arg-type]
    except TypeError as error:
        valid = ", ".join(f for f in HookConfig.__dataclass_fields__ if f != "targets")
        raise ConfigError(f"unknown hook option in {sorted(options)}: expected some of {valid} ({error})") from None
    return install_config(config, registry=registry)


def active_handle() -> HookHandle | None:
    session = _session
    return session.handle if session is not None else None


def _after_fork_in_child() -> None:
    if _session is not None:
        _session.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
