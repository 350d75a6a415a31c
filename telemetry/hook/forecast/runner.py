"""The live forecast's thread: every interval, the allocator's segments in, a forecast per prefill length out.

One `Forecaster` per process with the forecast on (MEMTEL_FORECAST_TOKENS), started with the process's
exporter. A cycle (`run_once`):
1. the workload: `set_forecast_workload` (program), else vLLM's (read at `Worker.load_model`), else
   MEMTEL_FORECAST_SHAPE (config), else the reference workload; none while the engine's model loads, and
   none in a vLLM model without a sparse-attention indexer (nothing to forecast);
2. the allocator's segments: on CUDA with the helper process, the allocator's events since the last cycle,
   which the helper replays on its shadow of the allocator (shadow.py: one full native snapshot to start, and
   again whenever the shadow is lost, counted by reason); else as bytes from the native snapshot reader
   (snapshot_native/: taken without holding the GIL), else `torch.cuda.memory_snapshot()` from the hook's
   allocator reader, or the allocator source's snapshot; none before the first hooked call bound a device;
3. if they, the workload and the allocator settings are what the last cycle saw (bytes compared as bytes; no
   event since the last cycle), the last forecasts stand;
   else `telemetry.model.indexer.forecast.forecast` for each length, on a simulator seeded with the segments;
4. the fit budget (budget.py) and the longest prefill that fits in it (`telemetry.model.indexer.fit`), searched
   again when the segments changed or the budget left the range where the last answer stays exact.

Never on the hooked call's path, and never raising: a failed cycle is counted by reason (`FAILURE_REASONS`),
leaves the forecast out until the next success, and is logged at most once a minute. A daemon thread: it never
keeps the process alive; `stop()` ends it (the session's close, at exit); a forked child starts its own.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from telemetry import hook_env
from telemetry.catalogue import metrics as catalogue
from telemetry.errors import ConfigError
from telemetry.hook import allocator
from telemetry.hook.forecast.helper import ForecastHelper, HelperError, ShadowInput
from telemetry.hook.forecast.shadow import LOST, START
from telemetry.hook.forecast.snapshot_native.events import unchanged
from telemetry.hook.forecast.snapshot_native.reader import ALLOCATOR_SOURCE, NativeSnapshots
from telemetry.hook.forecast.workload import REFERENCE, ForecastWorkload, process_alloc_conf, program_workload

if TYPE_CHECKING:
    from telemetry.fit_budget import BudgetBase, FitBudget
    from telemetry.hook.forecast.compute import CycleOutput
    from telemetry.model.indexer.fit import MaxFit
    from telemetry.model.indexer.forecast import Forecast

log = logging.getLogger("memtel.hook")

# Why a cycle failed (label `reason` of memtel_forecast_failures_total).
SNAPSHOT = "snapshot"                    # taking or reading the allocator's segments failed
UNSUPPORTED_STATE = "unsupported_state"  # the segments hold what the simulator does not model (SnapshotError)
SETTINGS = "settings"                    # the allocator settings cannot be simulated
SIMULATION = "simulation"                # anything else in the simulation
BUDGET = "budget"                        # the fit budget could not be read (the forecasts still stand)
UNAVAILABLE = "unavailable"              # the forecast cannot run in this process (no CUDA device): said once
FAILURE_REASONS = (SNAPSHOT, UNSUPPORTED_STATE, SETTINGS, SIMULATION, BUDGET, UNAVAILABLE)
LOG_EVERY_S = 60.0


class GilYield:
    """Called often from the forecast's simulation: at most every `every_s` of the thread's work, it sleeps
    `nap_s`, so a serving thread waiting for the GIL gets it then instead of after the interpreter's switch
    interval (5 ms by default, paid again at every GIL release of a hooked call). Measured in BENCHMARKS.md
    ("Live forecast in the hook")."""

    def __init__(self, every_s: float = 0.001, nap_s: float = 0.00005, *,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep) -> None:
        self.every_s = every_s
        self.nap_s = nap_s
        self.clock = clock
        self.sleep = sleep
        self.due = clock() + every_s

    def __call__(self) -> None:
        if self.clock() >= self.due:
            self.sleep(self.nap_s)
            self.due = self.clock() + self.every_s


@dataclass(frozen=True)
class ForecastResults:
    """What the collector exports: replaced whole after each cycle (readers need no lock)."""

    workload: ForecastWorkload | None = None
    forecasts: tuple[Forecast, ...] = ()     # empty: no forecast now (none yet, or the last cycle failed)
    last_duration_s: float | None = None     # wall time of the last cycle that got an allocator state
    last_success_s: float | None = None      # unix time of the snapshot of the last successful cycle
    failures: dict[str, int] = field(default_factory=dict)
    cpu_seconds: float = 0.0                 # CPU time of every cycle so far (the thread's cost)
    budget: FitBudget | None = None          # the fit budget of the last successful cycle (None: none to read)
    max_fit: MaxFit | None = None            # the longest prefill that fits in it (None: no budget, or no forecast)
    helper_cpu_seconds: float = 0.0          # CPU time the helper process spent simulating (not this process's)
    snapshot_reader: str | None = None       # which reader took the last snapshot (snapshot_native.reader)
    resyncs: dict[str, int] = field(default_factory=dict)   # full snapshots of the event shadow, by reason
    at_best: MaxFit | None = None            # the longest prefill that would fit with the cache released (compute.py)
    fit_conf: str | None = None              # the allocator settings the fit ran with (the cap torch reports added)

    def tune_inputs(self) -> dict[str, Any] | None:
        """What `memtel tune --hook` needs to answer as this gauge does: the workload (shape, width, launch
        pattern with its scale), the settings and the fit budget of the last successful cycle, and the gauge
        itself (served by /snapshot; None before a fit)."""
        workload, budget, fit = self.workload, self.budget, self.max_fit
        if workload is None or budget is None or fit is None or self.fit_conf is None:
            return None
        pattern = workload.pattern
        return {"shape": workload.shape.as_dict(), "mode": workload.mode,
                "pattern": None if pattern is None else {"keep_previous": pattern.keep_previous,
                                                         "transient_bytes": pattern.transient_bytes,
                                                         "row_scale": pattern.row_scale},
                "alloc_conf": self.fit_conf, "limit_bytes": budget.limit_bytes, "total_memory": budget.total_memory,
                "shared": budget.shared, "budget": budget.detail, "max_fit_tokens": fit.tokens,
                "taken_at": self.last_success_s}


def _same(segments: Any, last: Any, pause: Callable[[], None], batch: int = 64) -> bool:
    """Whether two snapshots' segments are equal: the native reader's bytes as bytes (one memcmp); torch's
    segments `batch` at a time with a pause between (a whole compare of 5,000 equal segments holds the GIL for
    several ms)."""
    if isinstance(segments, ShadowInput):   # the events since the last cycle: none, nothing changed
        return last is not None and segments.snapshot is None and unchanged(segments.events)
    if isinstance(segments, bytes) or isinstance(last, bytes):
        return bool(segments == last)
    if last is None or len(segments) != len(last):
        return False
    for start in range(0, len(segments), batch):
        if segments[start:start + batch] != last[start:start + batch]:
            return False
        pause()
    return True


def _fit_conf(conf: str, base: BudgetBase | None) -> str | None:
    """The settings the fit search runs with (compute.py): the process's, with the cap torch reports."""
    from telemetry.hook.forecast.compute import with_fraction

    return None if base is None else with_fraction(conf, base.fraction)


class ShadowGone(Exception):
    """The helper's event shadow was lost this cycle: take a full snapshot now."""


class SimulationFailed(Exception):
    def __init__(self, reason: str, message: object) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


class Forecaster:
    """Runs the live forecast of `tokens` every `interval_s` seconds in a daemon thread (see the module)."""

    def __init__(self, tokens: tuple[int, ...], interval_s: float, *, config_workload: ForecastWorkload | None = None,
                 waiting_for_model: Callable[[], bool] = lambda: False,
                 reader: Callable[[], Any] = allocator.current_reader, environ: Mapping[str, str] = os.environ,
                 clock: Callable[[], float] = time.time, helper: bool = True) -> None:
        self.tokens = tokens
        self.interval_s = interval_s
        self.config_workload = config_workload
        self.waiting_for_model = waiting_for_model
        self.reader = reader
        self.environ = environ
        self.clock = clock
        self.results = ForecastResults()
        self._engine_workload: ForecastWorkload | None = None
        self._no_indexer: str | None = None      # why the engine's model has nothing to forecast
        self._reference: ForecastWorkload | None = None
        self._checked_confs: dict[str, str | None] = {}   # alloc conf -> None (simulable) or the error
        # The simulation's process (helper.py); None: in this process (tests, and where asked).
        self._helper: ForecastHelper | None = ForecastHelper() if helper else None
        self._native = NativeSnapshots(environ)   # CUDA's segments without the GIL, where it builds and loads
        self._reset_threads()

    def _reset_threads(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # (device, workload, alloc conf) of the last forecasts
        self._last_key: tuple[int | None, ForecastWorkload, str] | None = None
        self._last_segments: Any = None          # and the snapshot's segments they started from
        self._said_no_budget = False
        self._budget_failing = False   # said once per run of failed budget reads (counted every time)
        self._said_budget: str | None = None
        self._said_off = False
        self._last_counters: tuple[int, int] | None = None   # (allocated, reserved) of the last simulated state
        self._last_log = -LOG_EVERY_S
        self._unlogged = 0
        self._announced: ForecastWorkload | None = None
        self._said_no_snapshot = False
        self._following: tuple[Any, ...] | None = None   # the event shadow's (device, conf) the helper follows
        self._resync_reason = START                      # why the next full snapshot is taken
        self._total_memory: dict[int, int | None] = {}

    # ---- the workload ---------------------------------------------------------------------------

    def model_loaded(self, worker: Any) -> None:
        """An engine's model-loaded signal returned: read the workload from its config, where the engine's module
        reads one (telemetry/engines/; vLLM's `Worker.load_model`). Never raises."""
        from telemetry.engines import ENGINES
        from telemetry.engines.registry import NoIndexer
        from telemetry.hook.forecast.workload import engine_workload

        fallback = hook_env.FORECAST_SHAPE if self.config_workload else "the reference workload"
        readers = [engine for engine in ENGINES if engine.workload is not None and engine.owns is not None]
        engine = next((engine for engine in readers if engine.owns is not None and engine.owns(worker)), None)
        if engine is None:   # another engine: nothing to read from it
            log.info("memtel: live forecast in pid %d: the loaded engine is not a %s worker; using %s",
                     os.getpid(), " or ".join(e.title for e in readers), fallback)
            return
        try:
            self._engine_workload = engine_workload(engine, worker, self.environ)
        except NoIndexer as reason:
            self._no_indexer = str(reason)
            if self.config_workload is None:
                log.info("memtel: live forecast off in pid %d: %s", os.getpid(), reason)
        except Exception as error:   # an engine that keeps its config elsewhere
            log.warning("memtel: live forecast in pid %d: cannot read the indexer workload from %s's config (%r); "
                        "using %s", os.getpid(), engine.title, error, fallback)

    def workload(self) -> ForecastWorkload | None:
        """The workload to forecast now; None: none yet (the model is loading) or nothing to forecast."""
        chosen = program_workload() or self._engine_workload or self.config_workload
        if chosen is not None:
            return chosen
        if self._no_indexer is not None or self.waiting_for_model():
            return None
        if self._reference is None:
            from telemetry.hook.forecast.workload import make_workload
            from telemetry.model.indexer.shape import REFERENCE_SHAPE

            self._reference = make_workload(REFERENCE_SHAPE, source=REFERENCE)
        return self._reference

    def describe(self) -> str:
        """For the hook's announcement: what is forecast, how often, from which workload."""
        lengths = " and ".join(f"{n:,}" for n in self.tokens)
        head = f"{lengths} tokens every {self.interval_s:g} s"
        # Not self.workload(): this runs at a process's first hooked call, which must not build the reference.
        workload = program_workload() or self._engine_workload or self.config_workload
        if workload is None and self._no_indexer is not None:
            return f"off ({self._no_indexer})"
        unavailable = self.unavailable()
        if unavailable is not None:
            return f"off ({unavailable})"
        if workload is not None:
            self._announced = workload   # the first cycle need not say it again
            return f"{head}, {workload.describe()}; {self._budget_rule()}"
        if self._no_indexer is not None:
            return f"off ({self._no_indexer})"
        if self.waiting_for_model():
            return f"{head}, once the model is loaded (the workload is read from the engine then)"
        return f"{head}, the reference workload ({hook_env.FORECAST_SHAPE} unset)"

    def _budget_rule(self) -> str:
        from telemetry.fit_budget import budget_rule

        try:
            return budget_rule(self.environ)
        except ConfigError as error:
            return f"no fit budget ({error})"

    # ---- one cycle ------------------------------------------------------------------------------

    def run_once(self) -> bool:
        """One forecast cycle now; True if it produced forecasts (or found them current). Never raises."""
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            return self._cycle(started)
        except Exception as error:
            self._failed(SIMULATION, error, started)
            return False
        finally:
            with self._lock:
                self.results = replace(self.results, cpu_seconds=self.results.cpu_seconds + time.thread_time() - cpu)

    def _cycle(self, started: float) -> bool:
        from telemetry.model.allocsim.config import AllocatorConfigError, parse_alloc_conf

        workload = self.workload()
        if workload is None:
            return False
        unavailable = self.unavailable()
        if unavailable is not None:
            self._off(unavailable)
            return False
        if workload != self._announced:
            self._announced = workload
            log.info("memtel: live forecast in pid %d of %s tokens: %s", os.getpid(),
                     ", ".join(f"{n:,}" for n in self.tokens), workload.describe())
        taken_at = self.clock()   # the forecast is the allocator's as of this moment
        try:
            taken = self._take()
        except Exception as error:
            self._failed(SNAPSHOT, error, started)
            return False
        if taken is None:   # no allocator yet (or a source without a snapshot): nothing to forecast, nothing failed
            if getattr(self.reader(), "snapshot_source", False) is None and not self._said_no_snapshot:
                self._said_no_snapshot = True
                log.warning("memtel: live forecast in pid %d: the allocator source gives no snapshot "
                            "(set_allocator_source(..., snapshot=...)): nothing to forecast from", os.getpid())
            return False
        segments, device = taken
        conf = workload.alloc_conf if workload.alloc_conf is not None else process_alloc_conf(self.environ)
        if conf not in self._checked_confs:
            try:
                parse_alloc_conf(conf)
                self._checked_confs[conf] = None
            except AllocatorConfigError as error:
                self._checked_confs[conf] = str(error)
        problem = self._checked_confs[conf]
        if problem is not None:
            self._failed(SETTINGS, problem, started)
            return False
        pause = GilYield()
        base = self._budget_base(device)    # read beside the snapshot
        key = (device, workload, conf)
        previous = self.results
        same = key == self._last_key and bool(previous.forecasts) and _same(segments, self._last_segments, pause)
        if same:
            budget = None if base is None or self._last_counters is None else base.for_allocator(*self._last_counters)
            # The last search answers again only for the same limit: a different one may change what the simulated
            # allocator frees and retries on the way.
            if budget is None or (previous.max_fit is not None and previous.max_fit.limit_bytes == budget.limit_bytes):
                self._succeeded(workload, previous.forecasts, started, taken_at, budget,
                                previous.max_fit if budget is not None else None,
                                previous.at_best if budget is not None else None,
                                _fit_conf(conf, base))
                return True
        if self._stop.is_set():
            return False
        try:
            try:
                output = self._simulate(segments, device, workload, conf, () if same else self.tokens, base, pause)
            except ShadowGone:   # the shadow was lost on these events: a full snapshot now
                taken = self._take()
                if taken is None:
                    return False
                segments, device = taken
                same = False
                output = self._simulate(segments, device, workload, conf, self.tokens, base, pause)
        except SimulationFailed as failure:
            self._failed(failure.reason, failure.message, started)
            return False
        self._last_key, self._last_segments = key, segments
        self._last_counters = (output.allocated_bytes, output.reserved_bytes)
        forecasts = previous.forecasts if same else output.forecasts
        self._succeeded(workload, forecasts, started, taken_at, output.budget, output.max_fit, output.at_best,
                        _fit_conf(conf, base))
        return True

    def _take(self) -> tuple[Any, int | None] | None:
        """(the segments: bytes from the native reader, else torch's or the source's list; the device), or None
        (nothing to forecast from yet). Raises what the snapshot raises."""
        reader = self.reader()
        if isinstance(reader, allocator.CudaAllocatorReader):
            device = reader.bound_device
            if device is None:
                return None
            data = self._native.take() if self._helper is None or not self._native.events_on() else None
            kind = self._native.reader
            taken: tuple[Any, int | None] | None
            if self._helper is not None and self._native.events_on():
                taken = (self._shadow_input(device), device)
            else:
                taken = reader.snapshot() if data is None else (data, device)
        else:
            kind, taken = ALLOCATOR_SOURCE, reader.snapshot()
        if taken is not None and self.results.snapshot_reader != kind:
            with self._lock:
                self.results = replace(self.results, snapshot_reader=kind)
        return taken

    def _shadow_input(self, device: int) -> ShadowInput:
        """The events since the last cycle where the helper follows this device; else a full native snapshot and the
        events logged around it (the shadow starts again there; counted by reason)."""
        options = {"device": device, "conf": process_alloc_conf(self.environ),
                   "total_memory": self._device_memory(device)}
        key = (device, options["conf"])
        if self._following == key:
            events = self._native.take_events()
            if not unchanged(events):
                self._following = None   # until the helper says it replayed them
            return ShadowInput(events, None, options)
        reason, self._resync_reason = self._resync_reason, LOST
        with self._lock:
            resyncs = dict(self.results.resyncs)
            resyncs[reason] = resyncs.get(reason, 0) + 1
            self.results = replace(self.results, resyncs=resyncs)
        self._following = None
        snapshot = self._native.take()
        assert snapshot is not None
        return ShadowInput(self._native.take_events(), snapshot, options)

    def _device_memory(self, device: int) -> int | None:
        if device not in self._total_memory:
            try:
                torch = sys.modules["torch"]
                self._total_memory[device] = int(torch.cuda.get_device_properties(device).total_memory)
            except Exception:
                self._total_memory[device] = None
        return self._total_memory[device]

    def _simulate(self, segments: Any, device: int | None, workload: ForecastWorkload, conf: str,
                  tokens: tuple[int, ...], base: BudgetBase | None, pause: Callable[[], None]) -> CycleOutput:
        """The cycle's simulation: in the helper process (helper.py), or here without one. SimulationFailed."""
        from telemetry.hook.forecast.compute import decode_output, encode_request, run_cycle
        from telemetry.hook.forecast.snapshot_native.codec import SnapshotBytesError
        from telemetry.model.allocsim.snapshot import SnapshotError

        if self._helper is None:
            try:
                return run_cycle(segments, device, workload, conf, tokens, base, pause)
            except SnapshotBytesError as error:
                raise SimulationFailed(SNAPSHOT, error) from None
            except SnapshotError as error:
                raise SimulationFailed(UNSUPPORTED_STATE, error) from None
        try:
            answer = self._helper.cycle(encode_request(device, workload, conf, tokens, base), segments, pause)
        except HelperError as error:
            self._following = None   # a new helper holds no shadow
            raise SimulationFailed(SIMULATION, error) from None
        with self._lock:
            self.results = replace(self.results,
                                   helper_cpu_seconds=self.results.helper_cpu_seconds + float(answer["cpu_seconds"]))
        followed = answer.get("shadow")
        if isinstance(segments, ShadowInput) and isinstance(followed, list) and followed:
            if followed[0] is True:
                self._following = (segments.options["device"], segments.options["conf"])
            else:
                self._following = None
                self._resync_reason = str(followed[1]) if len(followed) > 1 else LOST
                log.debug("memtel: live forecast in pid %d: event shadow lost (%s)", os.getpid(), followed[1:])
                if answer.get("error") == "shadow":
                    raise ShadowGone(self._resync_reason)
        if "ok" not in answer:
            raise SimulationFailed(str(answer.get("error", SIMULATION)), answer.get("message", "?"))
        return decode_output(answer["ok"])

    def unavailable(self) -> str | None:
        """Why the live forecast cannot run in this process (no CUDA device for the CUDA reader), else None."""
        reader = self.reader()
        if not isinstance(reader, allocator.CudaAllocatorReader):
            return None
        torch = sys.modules.get("torch")
        if torch is None or not hasattr(torch, "cuda"):
            return None   # not imported yet: the engine may still bring a device
        try:
            available = bool(torch.cuda.is_available())
        except Exception:
            available = False
        if available:
            return None
        return ("no CUDA device in this process (torch.cuda.is_available() is False): the live forecast simulates "
                "the CUDA caching allocator from its snapshot (another allocator: set_allocator_source(..., "
                "snapshot=...))")

    def _off(self, why: str) -> None:
        """Count a cycle that cannot run; say why once."""
        with self._lock:
            failures = dict(self.results.failures)
            failures[UNAVAILABLE] = failures.get(UNAVAILABLE, 0) + 1
            self.results = replace(self.results, failures=failures)
            said, self._said_off = self._said_off, True
        if not said:
            log.warning("memtel: live forecast off in pid %d: %s; %s{reason=%r} counts its cycles", os.getpid(), why,
                        catalogue.FORECAST_FAILURES.series, UNAVAILABLE)

    def _budget_base(self, device: int | None) -> BudgetBase | None:
        """The fit budget's base now; None (counted under `budget` when reading it failed, said once when there is
        none)."""
        from telemetry.fit_budget import read_budget_base

        try:
            base = read_budget_base(self.reader(), device, environ=self.environ)
        except Exception as error:
            # The gauge is absent for this cycle (never a guess); counted every time, logged once per run of failures.
            self._tally(BUDGET)
            if not self._budget_failing:
                self._budget_failing = True
                log.warning("memtel: live forecast in pid %d: cannot read the fit budget (%s): %s is left out until "
                            "it can; %s{reason=\"%s\"} counts each cycle", os.getpid(), error,
                            catalogue.FORECAST_MAX_PREFILL_TOKENS.series, catalogue.FORECAST_FAILURES.series, BUDGET)
            return None
        if self._budget_failing:
            self._budget_failing = False
            log.info("memtel: live forecast in pid %d: the fit budget can be read again", os.getpid())
        if base is not None and base.memory != self._said_budget:
            self._said_budget = base.memory
            log.info("memtel: live forecast in pid %d: %s fit budget: %s", os.getpid(), base.memory, base.detail)
        if base is None and not self._said_no_budget:
            self._said_no_budget = True
            log.info("memtel: live forecast in pid %d: no fit budget (the allocator source gives none: "
                     "set_forecast_budget); %s is not exported", os.getpid(),
                     catalogue.FORECAST_MAX_PREFILL_TOKENS.series)
        return base

    def _succeeded(self, workload: ForecastWorkload, forecasts: tuple[Forecast, ...], started: float,
                   taken_at: float, budget: FitBudget | None = None, max_fit: MaxFit | None = None,
                   at_best: MaxFit | None = None, fit_conf: str | None = None) -> None:
        with self._lock:
            old = self.results
            self.results = ForecastResults(workload, forecasts, time.perf_counter() - started, taken_at,
                                           old.failures, old.cpu_seconds, budget, max_fit, old.helper_cpu_seconds,
                                           old.snapshot_reader, old.resyncs, at_best, fit_conf)

    def _failed(self, reason: str, error: object, started: float) -> None:
        with self._lock:
            old = self.results
            self.results = ForecastResults(old.workload, (), time.perf_counter() - started, old.last_success_s,
                                           old.failures, old.cpu_seconds, helper_cpu_seconds=old.helper_cpu_seconds,
                                           snapshot_reader=old.snapshot_reader, resyncs=old.resyncs)
            self._last_key = None
        self._count(reason, error)

    def _tally(self, reason: str) -> None:
        with self._lock:
            failures = dict(self.results.failures)
            failures[reason] = failures.get(reason, 0) + 1
            self.results = replace(self.results, failures=failures)

    def _count(self, reason: str, error: object) -> None:
        """Count a failure by reason and log it (at most once a minute)."""
        self._tally(reason)
        with self._lock:
            now = time.monotonic()
            if now - self._last_log < LOG_EVERY_S:
                self._unlogged += 1
                return
            self._last_log, unlogged, self._unlogged = now, self._unlogged, 0
        more = f" ({unlogged} more failures in the last minute)" if unlogged else ""
        log.warning("memtel: live forecast failed in pid %d (%s): %s%s; %s counts them, next try in %g s",
                    os.getpid(), reason, error, more, catalogue.FORECAST_FAILURES.series, self.interval_s)

    # ---- the thread -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread (once; again in a forked child); under MEMTEL_HOOK_HISTORY=1 with torch loaded, torch's
        allocator recorder too, for /snapshot's history (history.py)."""
        from telemetry.hook.forecast.history import recording_asked, start_torch_recording
        from telemetry.hook.forecast.published import publish

        torch = sys.modules.get("torch")
        if torch is not None and recording_asked():
            start_torch_recording(torch)
        publish(lambda: self.results.tune_inputs(), owner=self)
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(target=self._loop, args=(self._stop,), name="memtel-forecast",
                                            daemon=True)
            thread = self._thread
        thread.start()

    def _loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.run_once()
            stop.wait(self.interval_s)

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def stop(self, timeout: float = 2.0) -> None:
        """End the thread: it stops between two forecasts, so this waits at most one forecast (or `timeout`)."""
        from telemetry.hook.forecast.published import withdraw

        withdraw(self)
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and thread.is_alive():
            thread.join(timeout)
        if self._helper is not None:
            self._helper.close()
        self._native.stop_events()
        self._following = None

    def reset_after_fork(self) -> None:
        """A forked child has no thread and another allocator: it starts again (with its exporter)."""
        stopped = self._stop.is_set()
        self._reset_threads()
        if self._helper is not None:
            self._helper.forget_after_fork()
        self._native.forget_after_fork()
        self._following, self._resync_reason = None, START
        if stopped:
            self._stop.set()
        self.results = ForecastResults(self.results.workload)


__all__ = ["BUDGET", "FAILURE_REASONS", "SETTINGS", "SIMULATION", "SNAPSHOT", "UNAVAILABLE", "UNSUPPORTED_STATE",
           "ForecastResults", "Forecaster", "SimulationFailed"]
