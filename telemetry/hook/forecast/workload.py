"""What the live forecast simulates: the running server's indexer workload, and where it came from.

A `ForecastWorkload` is an `IndexerShape` (telemetry/model/indexer/shape.py) with the width mode, the launch
pattern, the allocator settings and its source, one of:

- `program`: the program said so with `set_forecast_workload` (the lab server's ranks do);
- an engine's name (`vllm`): read from the engine's configuration and the loaded model when its model-loaded
  signal returns, by the engine's module (telemetry/engines/vllm.py: `Engine.workload`);
- `config`: MEMTEL_FORECAST_SHAPE (or `install(forecast_shape=...)`);
- `reference`: IndexerShape's reference workload, where nothing else says more.

The model (telemetry/model) is imported only when a workload is built (never by `import telemetry.hook`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from telemetry import hook_env
from telemetry.engines import ENGINES
from telemetry.engines.registry import Engine
from telemetry.errors import ConfigError
from telemetry.hook.forecast.settings import parse_shape_pairs

if TYPE_CHECKING:
    from telemetry.model.indexer.prefill import LaunchPattern
    from telemetry.model.indexer.shape import IndexerShape

PROGRAM = "program"
VLLM = "vllm"
CONFIG = "config"
REFERENCE = "reference"
# the engines whose module reads the workload from their worker (telemetry/engines/: vLLM's)
ENGINE_SOURCES = tuple(engine.name for engine in ENGINES if engine.workload is not None)
SOURCES = (PROGRAM, *ENGINE_SOURCES, CONFIG, REFERENCE)
SOURCE_WORDS = {PROGRAM: "set by the program with set_forecast_workload",
                **{engine.name: f"read from {engine.title}'s config" for engine in ENGINES if engine.workload},
                CONFIG: f"from {hook_env.FORECAST_SHAPE}",
                REFERENCE: f"the reference workload: {hook_env.FORECAST_SHAPE} unset"}

# torch reads PYTORCH_ALLOC_CONF first and PYTORCH_CUDA_ALLOC_CONF, its older name, after it
# (c10/core/AllocatorConfig.h).
ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def process_alloc_conf(environ: Mapping[str, str] = os.environ) -> str:
    """The allocator settings this process's environment gives torch ("" for the defaults)."""
    for name in ALLOC_CONF_VARIABLES:
        text = environ.get(name, "")
        if text.strip():
            return text
    return ""


@dataclass(frozen=True)
class ForecastWorkload:
    """The indexer workload of the running server, as the forecast simulates it.

    shape: the indexer's shape; mode: "stock" or "fixed"; pattern: the launch loop's pattern
    (`telemetry.model.indexer.prefill.LaunchPattern`; None: the default, the previous logits kept alive);
    alloc_conf: the allocator settings to simulate (None: the process's, `process_alloc_conf()`, at each run);
    source: one of SOURCES; details: more of what was read, for the log and the info metric (e.g. top-k).
    """

    shape: IndexerShape
    mode: str = "stock"
    source: str = REFERENCE
    pattern: LaunchPattern | None = None
    alloc_conf: str | None = None
    details: tuple[tuple[str, str], ...] = field(default=())

    def describe(self) -> str:
        s = self.shape
        text = (f"{s.layers} indexer layers, {s.chunk:,}-token chunks, max-model-len {s.max_model_len:,}, "
                f"compress ratio {s.compress_ratio}, logits budget {s.logits_budget_mib:g} MiB, {self.mode} width")
        if self.mode == "fixed":
            text += f" {s.padded_width:,}"
        if s.topk:
            text += f", top-k {s.topk}"
        if self.pattern is not None and getattr(self.pattern, "row_scale", 1.0) != 1.0:
            text += f", rows x {self.pattern.row_scale:g}"
        for key, value in self.details:
            text += f", {key} {value}"
        return f"{text} ({SOURCE_WORDS.get(self.source, self.source)})"

    def info_labels(self) -> dict[str, str]:
        s = self.shape
        return {"source": self.source, "mode": self.mode, "layers": str(s.layers), "chunk": str(s.chunk),
                "compress_ratio": str(s.compress_ratio), "max_model_len": str(s.max_model_len),
                "logits_budget_bytes": str(s.logits_budget_bytes), "padded_width": str(s.padded_width),
                "topk": str(s.topk)}


def make_workload(shape: Any, *, mode: str = "stock", source: str = PROGRAM, pattern: Any = None,
                  alloc_conf: str | None = None, details: tuple[tuple[str, str], ...] = ()) -> ForecastWorkload:
    """A checked workload: ConfigError names what is wrong."""
    from telemetry.model.allocsim.config import parse_alloc_conf
    from telemetry.model.indexer.planner import check_mode
    from telemetry.model.indexer.prefill import LaunchPattern
    from telemetry.model.indexer.shape import IndexerShape

    if not isinstance(shape, IndexerShape):
        raise ConfigError(f"the forecast's shape must be a telemetry.model.indexer.shape.IndexerShape, got {shape!r}")
    if pattern is not None and not isinstance(pattern, LaunchPattern):
        raise ConfigError("the forecast's pattern must be a telemetry.model.indexer.prefill.LaunchPattern, "
                          f"got {pattern!r}")
    if source not in SOURCES:
        raise ConfigError(f"forecast workload source must be one of {', '.join(SOURCES)}, got {source!r}")
    if alloc_conf is not None:
        parse_alloc_conf(alloc_conf)   # AllocatorConfigError (a ConfigError) names the bad setting
    return ForecastWorkload(shape, check_mode(mode), source, pattern, alloc_conf, tuple(details))


def engine_workload(engine: Engine, worker: Any, environ: Mapping[str, str] = os.environ) -> ForecastWorkload:
    """The workload `engine`'s module reads from its `worker` (source: the engine's name). NoIndexer
    (telemetry.engines.registry) if the model has none; AttributeError / ConfigError where the engine keeps its
    configuration elsewhere than its module reads."""
    if engine.workload is None:
        raise ConfigError(f"memtel does not read {engine.title}'s indexer workload")
    read = engine.workload(worker, environ)
    return make_workload(read.shape, mode=read.mode, source=engine.name, details=read.details)


def workload_from_text(text: str, name: str = hook_env.FORECAST_SHAPE) -> ForecastWorkload:
    """MEMTEL_FORECAST_SHAPE's `key=value,...` (settings.SHAPE_KEYS) over the reference workload."""
    from telemetry.model.indexer.shape import REFERENCE_SHAPE, IndexerShape, budget_bytes_from_mib

    pairs = parse_shape_pairs(text, name)
    values: dict[str, Any] = REFERENCE_SHAPE.as_dict()
    mode = pairs.pop("mode", "stock")
    for key, raw in pairs.items():
        if key == "budget_mb":
            try:
                values["logits_budget_bytes"] = budget_bytes_from_mib(float(raw))
            except ValueError as error:   # float() or ShapeError (a ConfigError, so a ValueError)
                raise ConfigError(f"{name}: budget_mb={raw!r}: expected a number of MiB such as 512 ({error})") \
                    from None
            continue
        if not (raw.isascii() and raw.isdigit()):
            raise ConfigError(f"{name}: {key}={raw!r} is not a non-negative integer")
        values[key] = int(raw)
    try:
        return make_workload(IndexerShape(**values), mode=mode, source=CONFIG)
    except ConfigError as error:
        raise ConfigError(f"{name}: {error}") from None


_lock = threading.Lock()
_program_workload: ForecastWorkload | None = None


def set_forecast_workload(shape: Any, *, mode: str = "stock", pattern: Any = None,
                          alloc_conf: str | None = None) -> None:
    """Tell the live forecast the indexer workload of this program (source `program`); None clears it.

    shape: a `telemetry.model.indexer.shape.IndexerShape`; mode: "stock" or "fixed"; pattern: the launch loop's
    `telemetry.model.indexer.prefill.LaunchPattern` (None: the default); alloc_conf: the allocator settings to
    simulate in PYTORCH_CUDA_ALLOC_CONF syntax (None: the process's environment). Raises ConfigError.
    """
    global _program_workload
    workload = None if shape is None else make_workload(shape, mode=mode, pattern=pattern, alloc_conf=alloc_conf)
    with _lock:
        _program_workload = workload


def program_workload() -> ForecastWorkload | None:
    return _program_workload


__all__ = ["ALLOC_CONF_VARIABLES", "CONFIG", "ENGINE_SOURCES", "PROGRAM", "REFERENCE", "SOURCES", "VLLM",
           "ForecastWorkload", "engine_workload", "make_workload", "process_alloc_conf", "program_workload",
           "set_forecast_workload", "workload_from_text"]
