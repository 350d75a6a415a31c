"""The forecast thread's native snapshot reader: found in the cache, else built in the background, else off.

`NativeSnapshots.take()` returns the allocator's segments as bytes (codec.py), taken by the extension with the
GIL released, or None while there is no extension (yet): then the thread takes `torch.cuda.memory_snapshot()`
as before. The first call looks for this torch's build (build.py); a missing one is compiled by a background
process at low priority, never waited for (the forecast runs on torch's snapshot meanwhile, and the cycle after
the build ends loads it). Off for good, said once in the log and in
`memtel_forecast_snapshot_reader_info{reader="memory_snapshot"}`: `MEMTEL_FORECAST_SNAPSHOT=python`, a torch
without CUDA, a build that failed (now or before: the cache's `failed.txt`), took over `BUILD_TIMEOUT_S`, or a
library that is not this user's or does not load.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from telemetry import hook_env
from telemetry.catalogue import metrics as catalogue
from telemetry.errors import shown

log = logging.getLogger("memtel.hook")

VARIABLE = hook_env.FORECAST_SNAPSHOT
CHOICES = ("native", "python")
BUILD_TIMEOUT_S = 900.0
BUILD_MAIN = "import sys; from telemetry.hook.forecast.snapshot_native.build import main; sys.exit(main())"
# Which reader took the forecast's last snapshot (label `reader` of memtel_forecast_snapshot_reader_info).
NATIVE = "native"                      # this extension: the GIL released while it walks the allocator
MEMORY_SNAPSHOT = "memory_snapshot"    # torch.cuda.memory_snapshot(): Python objects built under the GIL
ALLOCATOR_SOURCE = "allocator_source"  # set_allocator_source(..., snapshot=...)


SHADOW_VARIABLE = hook_env.FORECAST_SHADOW   # on (default): the event shadow after one full snapshot; off: none
EVENT_CAP = 1 << 20   # the most allocator events kept between two cycles (48 bytes each); more: a full snapshot
# The event log is one per process (the extension's): one reader takes it at a time (another would take events
# the first one's shadow needs).
_events_lock = threading.Lock()
_events_owner: NativeSnapshots | None = None


def build_command(directory: Path) -> list[str]:
    """The background build's command line. Isolated (`-I`): neither the engine's working directory (where anyone
    who can write there could plant a `telemetry/` package) nor PYTHON* variables decide what it imports. It gets
    this process's import path instead (absolute entries only, memtel's own root first, the working directory left
    out), so it imports the memtel and the torch this process runs."""
    root = str(Path(__file__).resolve().parents[4])
    here = os.getcwd()
    paths = list(dict.fromkeys([root, *(p for p in sys.path if os.path.isabs(p) and (p == root or p != here))]))
    return [sys.executable, "-I", "-c", f"import sys; sys.path[:0] = {paths!r}; {BUILD_MAIN}", str(directory)]


def coalesce_pairs(environ: Mapping[str, str]) -> bool:
    """Whether the extension may leave out a block allocated and freed with nothing logged in between (it leaves the
    allocator as it was): not under a garbage-collection threshold, where every allocation ages the free blocks."""
    from telemetry.hook.forecast.workload import process_alloc_conf

    return "garbage_collection_threshold" not in process_alloc_conf(environ)


def coalesced(module: Any) -> int | None:
    """Alloc/free pairs the extension left out of the log since it was attached (None: an older build)."""
    try:
        return int(module.coalesced())
    except Exception:
        return None


class NativeSnapshots:
    """One per forecaster: the extension's module once loaded; `off` says why there is none for good."""

    def __init__(self, environ: Mapping[str, str] = os.environ, *, command: list[str] | None = None,
                 timeout_s: float = BUILD_TIMEOUT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.environ = environ
        self.command = command
        self.timeout_s = timeout_s
        self.clock = clock
        self.module: Any = None
        self.off: str | None = None
        self.directory: Path | None = None
        self._build: subprocess.Popen[bytes] | None = None
        self._build_started = 0.0
        self.events_off: str | None = None   # why the event log is off (None: on, or not tried yet)
        self._events_on = False

    @property
    def reader(self) -> str:
        return NATIVE if self.module is not None else MEMORY_SNAPSHOT

    @property
    def building(self) -> bool:
        return self._build is not None

    def take(self) -> bytes | None:
        """The snapshot's bytes, or None where the extension is not there (yet). Raises what the allocator
        raises (counted by the thread as a failed snapshot)."""
        module = self.module
        if module is None:
            if self.off is not None:
                return None
            module = self._advance()
            if module is None:
                return None
        data: bytes = module.snapshot_bytes()
        return data

    def events_on(self) -> bool:
        """Whether the allocator's events are logged (the extension's trace tracker, attached at the first call
        with the extension loaded; MEMTEL_FORECAST_SHADOW=off, or a tracker the allocator refuses: off, said
        once). Never raises."""
        if self._events_on or self.module is None or self.events_off is not None:
            return self._events_on
        global _events_owner
        choice = self.environ.get(SHADOW_VARIABLE, "").strip() or "on"
        if choice != "on":
            self.events_off = f"{SHADOW_VARIABLE}={shown(choice, 40)}"
            if choice != "off":
                log.warning("memtel: live forecast in pid %d: %s: expected on or off; the event shadow is off",
                            os.getpid(), self.events_off)
            return False
        with _events_lock:
            if _events_owner is not None:
                self.events_off = "another live forecast in this process follows the allocator's events"
                log.info("memtel: live forecast in pid %d: %s: a full snapshot every cycle", os.getpid(),
                         self.events_off)
                return False
            try:
                self.module.attach_events(EVENT_CAP, coalesce=coalesce_pairs(self.environ))
            except Exception as error:   # another allocator backend (cudaMallocAsync), an older build
                self.events_off = f"{type(error).__name__}: {error}"[:300]
                log.warning("memtel: live forecast in pid %d: the allocator's events cannot be followed (%s): a "
                            "full snapshot every cycle", os.getpid(), self.events_off)
                return False
            _events_owner = self
        self._events_on = True
        log.info("memtel: live forecast in pid %d: following the allocator's events (a full snapshot only to start "
                 "or resync)", os.getpid())
        return True

    def stop_events(self) -> None:
        """Stop logging the allocator's events (the forecast stops): the log is emptied and keeps nothing more (the
        tracker stays attached, as torch cannot detach it, and drops what it is given). Never raises."""
        global _events_owner
        if not self._events_on:
            return
        self._events_on = False
        self.events_off = "stopped"
        with _events_lock:
            if _events_owner is self:
                _events_owner = None
            try:
                self.module.detach_events()
            except Exception as error:
                log.warning("memtel: live forecast in pid %d: cannot stop logging the allocator's events: %r",
                            os.getpid(), error)

    def take_events(self) -> bytes:
        """The allocator's events since the last take, as bytes (events.py)."""
        data: bytes = self.module.take_events()
        return data

    # ---- finding, building, loading ---------------------------------------------------------------------------

    def _advance(self) -> Any:
        try:
            if self._build is None:
                self._start()
            else:
                self._poll()
        except Exception as error:   # never into the thread: off, said once
            self._give_up(f"{type(error).__name__}: {error}")
        return self.module

    def _start(self) -> None:
        from telemetry.hook.forecast.snapshot_native import build

        choice = self.environ.get(VARIABLE, "").strip() or "native"
        if choice not in CHOICES:
            self._give_up(f"{VARIABLE}={shown(choice, 40)}: expected one of {', '.join(CHOICES)}")
            return
        if choice == "python":
            self._give_up(f"{VARIABLE}=python", quiet=True)
            return
        torch = sys.modules.get("torch")
        if torch is None or getattr(getattr(torch, "version", None), "cuda", None) is None:
            self._give_up("this torch has no CUDA")
            return
        directory = self.directory = build.build_directory(torch, dict(self.environ))
        failed = build.failure(directory)
        if failed is not None:
            self._give_up(f"its build in {directory} failed ({failed}; delete the folder to build again)")
            return
        try:
            build.trusted_file(directory)
        except FileNotFoundError:
            self._spawn(directory)
            return
        self._load(directory)

    def _spawn(self, directory: Path) -> None:
        from telemetry.hook.forecast.snapshot_native import build

        build.private_directory(directory)
        env = dict(self.environ)
        for name in (hook_env.TARGETS, hook_env.ENABLE):   # not a serving process: memtel run's bootstrap stays off
            env.pop(name, None)
        command = self.command or build_command(directory)
        fd = os.open(directory / build.LOG, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:   # in the build's own private folder: the engine's working directory is nobody's to trust
            self._build = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, env=env,
                                           close_fds=True, cwd=directory)
        finally:
            os.close(fd)
        self._build_started = self.clock()
        log.info("memtel: live forecast in pid %d: building the native snapshot reader in %s (pid %d, in the "
                 "background; torch.cuda.memory_snapshot() meanwhile)", os.getpid(), directory, self._build.pid)

    def _poll(self) -> None:
        from telemetry.hook.forecast.snapshot_native import build

        process, directory = self._build, self.directory
        assert process is not None and directory is not None
        code = process.poll()
        if code is None:
            if self.clock() - self._build_started > self.timeout_s:
                process.kill()
                process.wait(5)
                self._build = None
                self._give_up(f"its build took over {self.timeout_s:g} s (log: {directory / build.LOG})")
            return
        self._build = None
        if code != 0:
            reason = build.failure(directory) or f"the build exited with {code}"
            self._give_up(f"its build failed ({reason}; log: {directory / build.LOG})")
            return
        self._load(directory)

    def _load(self, directory: Path) -> None:
        import importlib.util

        from telemetry.hook.forecast.snapshot_native import build
        from telemetry.hook.forecast.snapshot_native.codec import FORMAT_VERSION

        library = build.trusted_file(directory)
        name = build.module_name(directory.name)
        module = sys.modules.get(name)   # loaded already in this process (another forecaster's): once is enough
        if module is None:
            spec = importlib.util.spec_from_file_location(name, library)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {library}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules[name] = module
        if getattr(module, "FORMAT_VERSION", None) != FORMAT_VERSION:
            raise ImportError(f"{library} writes format {getattr(module, 'FORMAT_VERSION', None)}, not "
                              f"{FORMAT_VERSION}")
        self.module = module
        log.info("memtel: live forecast in pid %d: native snapshot reader loaded (%s): the allocator's segments are "
                 "copied without holding the GIL", os.getpid(), library)

    def _give_up(self, why: str, *, quiet: bool = False) -> None:
        if self.off is not None:
            return
        self.off = why
        (log.info if quiet else log.warning)(
            "memtel: live forecast in pid %d: native snapshot reader off (%s): taking torch.cuda.memory_snapshot() "
            "instead, which holds the GIL while it builds the segments (%s{reader=\"%s\"})", os.getpid(), why,
            catalogue.FORECAST_SNAPSHOT_READER_INFO.series, MEMORY_SNAPSHOT)

    def forget_after_fork(self) -> None:
        """A forked child does not own the parent's build: it looks again at its first cycle (a build still
        running then is waited for by the child's own builder, behind the lock)."""
        self._build = None


__all__ = ["ALLOCATOR_SOURCE", "EVENT_CAP", "MEMORY_SNAPSHOT", "NATIVE", "SHADOW_VARIABLE", "VARIABLE",
           "NativeSnapshots", "build_command", "coalesce_pairs", "coalesced"]
