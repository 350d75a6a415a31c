"""What memtel run's bootstrap does in each Python process it reaches (bootstrap/sitecustomize.py).

`boot()` reads the hook's configuration from the environment memtel run set (`HookConfig.from_env`,
the same variables as the vLLM plugin) and installs the hook, with three triggers for the unresolved
check instead of install()'s 300 s timer (docs/hook.md, "Any engine: memtel run"):
- a serving engine's worker has loaded the model (vLLM's `Worker.load_model`, SGLang's
  `ModelRunner.load_model`: presets.MODEL_LOADED; an engine that is not installed is skipped);
- the process makes its first hooked call (targets still unresolved then are reported);
- MEMTEL_RUN_UNRESOLVED_AFTER_S seconds after the run's first Python process booted, if no process of
  the run has started its hook by then (the run's counter is 0) and that process is not a serving
  engine (vllm or sglang imported: its workers check when their model has loaded, which may take many
  minutes), and at that process's exit (engine or not): a warning only. That process is usually a
  launcher (an API server, torchrun), where an exporter would take the port of a rank that has not
  started yet.

The exporter and the call log start only where something records or a model was loaded, as with the
plugin. `boot()` never raises: a bad configuration is one log line and no hook. The `memtel` logger
gets a stderr handler (unless it has one already), so the hook's lines are seen in any program.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import sys
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from telemetry import hook_env
from telemetry.errors import ConfigError

if TYPE_CHECKING:  # the hook is imported only where it is on (like the plugin)
    from telemetry.hook.config import HookConfig
    from telemetry.hook.session import HookHandle

log = logging.getLogger("memtel.run")

UNRESOLVED_AFTER_ENV = hook_env.RUN_UNRESOLVED_AFTER_S
DEFAULT_UNRESOLVED_AFTER_S = 60.0
LOG_FORMAT = "%(asctime)s memtel[%(process)d] %(levelname)s %(message)s"

# True once boot() ran in this process: the vLLM plugin then leaves the hook to memtel run (one install).
RAN = False


def parse_delay(name: str, text: str) -> float | None:
    """Seconds > 0, or "off" (None)."""
    value = text.strip()
    if value.lower() == "off":
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"{name}={text!r} is not a delay: expected a number of seconds > 0 or \"off\"")
    return seconds


def config_from_env(environ: Mapping[str, str]) -> HookConfig | None:
    """The hook's configuration under memtel run; None when the hook is off; ConfigError names the bad variable."""
    from telemetry.hook.config import HookConfig
    from telemetry.hook.presets import ENGINE_MEMORY, MODEL_LOADED

    signals = tuple(signal for targets in MODEL_LOADED.values() for signal in targets)
    engine_memory = tuple(signal for targets in ENGINE_MEMORY.values() for signal in targets)
    return HookConfig.from_env(environ, model_loaded=signals, engine_memory=engine_memory, unresolved_after_s=None,
                               unresolved_at_first_call=True)


def show_log() -> None:
    """The `memtel` loggers' lines on stderr, at INFO (unless someone gave `memtel` a handler already)."""
    memtel = logging.getLogger("memtel")
    if memtel.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    memtel.addHandler(handler)
    memtel.setLevel(logging.INFO)
    memtel.propagate = False   # the program's own logging configuration would print them a second time


def boot(environ: Mapping[str, str] = os.environ) -> None:
    """Install the hook in this process from `environ`. Never raises."""
    global RAN
    RAN = True
    try:
        _clean_up_at_exit(environ)
    except Exception:
        pass
    if not environ.get(hook_env.TARGETS, "").strip() and not environ.get(hook_env.ENABLE, "").strip():
        return   # off, as HookConfig.from_env would say, without importing the hook
    try:
        show_log()
    except Exception:
        pass
    try:
        config = config_from_env(environ)
        delay = parse_delay(UNRESOLVED_AFTER_ENV, environ.get(UNRESOLVED_AFTER_ENV, "") or
                            str(DEFAULT_UNRESOLVED_AFTER_S))
    except ValueError as error:  # ConfigError: one line that says what is wrong
        log.error("memtel telemetry off in pid %d: %s", os.getpid(), error)
        return
    except Exception as error:
        log.error("memtel telemetry off in pid %d: reading the MEMTEL_* configuration failed: %r", os.getpid(), error)
        return
    if config is None:
        return
    try:
        from telemetry.hook import install_config

        handle = install_config(config)
    except Exception as error:
        log.error("memtel telemetry off in pid %d: installing the hook failed: %r", os.getpid(), error)
        return
    try:
        _watch_the_run(handle, environ, delay)
    except Exception as error:
        log.debug("memtel: no unresolved-target watch in pid %d: %r", os.getpid(), error)


def _clean_up_at_exit(environ: Mapping[str, str]) -> None:
    """In the run's program itself (the pid its run directory is named after): remove the directory at exit.
    Registered first, so it runs after every other exit handler of the hook (atexit runs them in reverse)."""
    from telemetry.hook import run_order as order

    directory = environ.get(order.RUN_DIR_ENV, "")
    if directory and order.owner_pid(directory) == os.getpid():
        atexit.register(order.remove_at_exit, directory)


def _watch_the_run(handle: HookHandle, environ: Mapping[str, str], delay: float | None) -> None:
    """In the run's first process: warn when no process of the run has hooked anything (after `delay`, at exit)."""
    from telemetry.hook import run_order as order

    directory = environ.get(order.RUN_DIR_ENV, "")
    if not directory or not order.claim_first(directory):
        return
    watch = _NothingHookedWatch(handle, directory)
    atexit.register(watch.check, "at the exit of the run's first process")
    if delay is not None:
        watch.timer = threading.Timer(delay, watch.check, args=(f"{delay:g} s after memtel run started",),
                                      kwargs={"engines_wait": True})
        watch.timer.daemon = True
        watch.timer.name = "memtel-run-unresolved-check"
        watch.timer.start()
        # A thread alive at fork() makes Python 3.12+ warn (DeprecationWarning; an error under -W error): a
        # program that forks loses the delayed warning, not its fork. The warning at exit stays.
        os.register_at_fork(before=watch.stop_timer)


class _NothingHookedWatch:
    def __init__(self, handle: HookHandle, directory: str) -> None:
        self.handle = handle
        self.directory = directory
        self.pid = os.getpid()
        self.timer: threading.Timer | None = None

    def stop_timer(self) -> None:
        timer, self.timer = self.timer, None
        if timer is not None and timer is not threading.current_thread():
            timer.cancel()
            timer.join(timeout=1.0)

    def check(self, when: str, engines_wait: bool = False) -> None:
        from telemetry.engines import ENGINES
        from telemetry.hook import run_order as order

        if os.getpid() != self.pid or not self.handle.active or self.handle.state.started:
            return   # a forked child, an uninstalled hook, or this process records: its own check reports
        if engines_wait and any(engine.package in sys.modules for engine in ENGINES if engine.package):
            return   # a serving engine: its workers report once their model has loaded
        if order.peek(self.directory) != 0:
            return   # some process of the run started its hook: it reports there (exporter and log)
        # A warning only (start=False): an exporter here would take a rank's port (see the module's doc).
        self.handle.check_unresolved(f"{when}, with no process of the run hooked yet,", start=False)


__all__ = ["DEFAULT_UNRESOLVED_AFTER_S", "RAN", "UNRESOLVED_AFTER_ENV", "boot", "config_from_env", "parse_delay"]
