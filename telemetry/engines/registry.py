"""The serving engines memtel knows: what an engine module declares, and where it registers it.

Registration (as the daemon's collectors do it, telemetry/daemon/registry.py): each module of
telemetry/engines/ (vllm.py, sglang.py, lab.py) declares its engine with `register(Engine(...))`, and
`telemetry.engines` imports every module of its folder. The hook's presets and signals
(telemetry/hook/presets.py), how it reads an engine's memory (telemetry/hook/engine.py) and its indexer
workload (telemetry/hook/forecast/workload.py), how it is launched and health-checked (harness/ab/serve.py,
lifecycle.py) and which of its switches `memtel tune` sets (telemetry/tune/engines.py) all come from these
registrations, so adding an engine is adding its file (and its tests).

An engine module imports neither torch nor its engine: it reads the engine's objects as the hook hands them
over (a worker, its model), and everything it cannot find is None, never an error in the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from telemetry.model.fitsearch.space import Setting
    from telemetry.model.indexer.shape import IndexerShape


@dataclass(frozen=True)
class PresetSite:
    """One call site of a preset (telemetry/hook/presets.py says how the hook uses them)."""

    target: str                      # "package.module:name"
    call_sites: tuple[str, ...]      # modules whose functions call it, looking the name up at call time
    # "module global" (a bare name bound at module level), "function-local import" (`from module import
    # name [as alias]` in the calling function) or "module attribute" (`module.name`, the module imported
    # at module level or in the function)
    lookup: str
    why: str
    layer: str | None = None         # "package.module:Class": the model layer that runs these calls


class NoIndexer(Exception):
    """The worker's model has no sparse-attention indexer: there is no indexer growth to forecast."""


@dataclass(frozen=True)
class EngineWorkload:
    """The indexer workload an engine's worker says it runs (the hook's forecast makes it a ForecastWorkload)."""

    shape: IndexerShape
    mode: str = "stock"
    details: tuple[tuple[str, str], ...] = ()  # more of what was read, for the log and the info metric


class Applied(NamedTuple):
    """What gives a setting to an engine: environment variables, command-line flags, and notes (what they cannot
    say)."""

    env: dict[str, str]
    flags: list[str]
    notes: list[str]


@dataclass(frozen=True)
class Tuning:
    """Which of the engine's switches `memtel tune` (telemetry/tune/engines.py) searches, and how it sets them.

    preset: the hook preset of its prefill logits (`memtel tune --preset` names the engine by it); modes: the
    logits-width modes it has a switch for (None: every mode of the indexer model, `MODES` of
    telemetry/model/indexer/planner.py, not imported here: the hook imports the engines); budget_is_setting: the
    logits budget is a MiB setting the search may change (else the engine sizes it itself and it is not searched);
    utilization_flag: the flag of its share of the device's memory, if it has one; apply(setting, budget_mib): the
    variables, flags and notes that give a searched setting (its mode, chunk and allocator settings; the budget as
    MiB text), but for the allocator's own variable, which the caller sets for every engine.
    """

    preset: str
    modes: tuple[str, ...] | None
    budget_is_setting: bool
    utilization_flag: str | None
    apply: Callable[[Setting, str], Applied]


@dataclass(frozen=True)
class Engine:
    """One serving engine, as the hook meets it inside its processes.

    name: the engine's short name (a `MEMTEL_*` value, a forecast workload source); title: how a sentence
    names it. order: its place in every list (presets, signals, readers tried in turn). presets: its named
    sets of hook targets. package: the Python package whose import means the engine runs in this process.
    Signals are "module:Class.method" targets whose return means: `model_loaded` the model is loaded (the
    unresolved-target check, the weights); `engine_memory` the KV cache is allocated or the CUDA graphs are
    captured; `start_begin` the start's memory budget is known; `started` (qualified-name suffixes) the start
    is over. Readers, each given the worker a signal returned from (None where it is not this engine's):
    `model` its model; `kv_cache` its KV cache's tensors; `start_plan` what it will hold once started
    (given what the process holds now); `workload` its indexer workload (NoIndexer: it has none), read only
    where `owns(worker)`. world: the module whose `_WORLD` group (a GroupCoordinator with `rank` and `local_rank`)
    names the process's rank once the engine initialized it (telemetry/hook/rank.py). serve: the command line that
    serves a model (`{model}`, `{host}`, `{port}` filled in by `serve_command`); every engine answers `HEALTH_PATH`
    with 200 once it takes requests and lists its max-model-len in `MODELS_PATH` (data[i].max_model_len), which is
    all the A/B runner asks of a server.
    tuning: what `memtel tune` sets (None: an engine tune does not search).
    """

    name: str
    title: str
    order: int
    presets: Mapping[str, tuple[PresetSite, ...]] = field(default_factory=dict)
    package: str | None = None
    model_loaded: tuple[str, ...] = ()
    engine_memory: tuple[str, ...] = ()
    start_begin: tuple[str, ...] = ()
    started: tuple[str, ...] = ()
    model: Callable[[Any], Any] | None = None
    kv_cache: Callable[[Any], list[Any] | None] | None = None
    start_plan: Callable[[Any, int | None], int | None] | None = None
    workload: Callable[[Any, Mapping[str, str]], EngineWorkload] | None = None
    owns: Callable[[Any], bool] | None = None
    world: str | None = None
    serve: tuple[str, ...] = ()
    tuning: Tuning | None = None


# What every registered engine answers (vLLM 0.32, SGLang 0.5.23 and the lab server; harness/ab/lifecycle.py asks).
HEALTH_PATH = "/health"
MODELS_PATH = "/v1/models"


def serve_command(engine: Engine, model: str, host: str, port: int, extra: Sequence[str] = ()) -> list[str]:
    """The command line that serves `model` on host:port with `engine`, then `extra` (the engine's own flags)."""
    if not engine.serve:
        raise ValueError(f"engine {engine.name!r} declares no command line")
    fields = {"{model}": model, "{host}": host, "{port}": str(port)}
    return [fields.get(part, part) for part in engine.serve] + list(extra)


_ENGINES: dict[str, Engine] = {}


def register(engine: Engine) -> Engine:
    """Called once by an engine's module: adds `engine` to the registry (a name or preset given twice is an error)."""
    if engine.name in _ENGINES:
        raise ValueError(f"engine {engine.name!r} is registered twice")
    taken = {name for other in _ENGINES.values() for name in other.presets}
    twice = sorted(taken & set(engine.presets))
    if twice:
        raise ValueError(f"engine {engine.name!r}: preset(s) {', '.join(twice)} already registered by another engine")
    if engine.tuning is not None and engine.tuning.preset not in engine.presets:
        raise ValueError(f"engine {engine.name!r}: its tuning names the preset {engine.tuning.preset!r}, not its own")
    _ENGINES[engine.name] = engine
    return engine


def registered() -> tuple[Engine, ...]:
    """Every registered engine in order (import telemetry.engines first: it loads them)."""
    return tuple(sorted(_ENGINES.values(), key=lambda engine: (engine.order, engine.name)))


def tensors_in(value: Any, depth: int = 0) -> Iterator[Any]:
    """Tensors in a tensor, list, tuple or dict of them (vLLM: a list of tensors; some backends nest)."""
    if depth > 4 or value is None:
        return
    if isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item, depth + 1)
    elif hasattr(value, "untyped_storage"):
        yield value


__all__ = ["HEALTH_PATH", "MODELS_PATH", "Applied", "Engine", "EngineWorkload", "NoIndexer", "PresetSite", "Tuning",
           "register", "registered", "serve_command", "tensors_in"]
