"""Named sets of hook targets, usable wherever a target is (`MEMTEL_TARGETS`, `install`).

Each engine's module (telemetry/engines/: vllm.py, sglang.py, lab.py) declares its presets and signals; this
module gathers them for the hook. Each site names the module attribute that its call site looks up *at call
time*: patching a name where it is defined does nothing for a module that imported it with `from ... import
name` before the patch, so the target is the attribute the caller actually reads. `call_sites` records which
module reads it and how; `layer` names the model layer whose forward makes those calls, so the hook can tell,
once the model is loaded, that a hooked function will never run in this model (vLLM imports the indexer's
modules in every worker, whatever the model). A target called from several places is one site per call site
(its layers are all of theirs). tests/hook/test_presets.py and test_presets_sglang.py check all three against
each engine's source (the versions are in each engine's module), read with `ast`, never imported.
"""

from __future__ import annotations

from telemetry.engines import ENGINES
from telemetry.engines.registry import PresetSite

PRESETS: dict[str, tuple[PresetSite, ...]] = {name: sites for engine in ENGINES
                                              for name, sites in engine.presets.items()}

# Methods whose return means "the model is loaded" in a serving engine: the hook then reports targets
# that have not resolved (docs/hook.md, "Unresolved targets"); the model is the worker's (Engine.model).
MODEL_LOADED: dict[str, tuple[str, ...]] = {engine.name: engine.model_loaded for engine in ENGINES
                                            if engine.model_loaded}

# Methods whose return means the engine allocated its KV cache or captured its CUDA graphs: the hook reads
# the engine's memory again then (telemetry/hook/engine.py).
ENGINE_MEMORY: dict[str, tuple[str, ...]] = {engine.name: engine.engine_memory for engine in ENGINES
                                             if engine.engine_memory}


def _layers() -> dict[str, tuple[str, ...]]:
    layers: dict[str, tuple[str, ...]] = {}
    for sites in PRESETS.values():
        for site in sites:
            if site.layer and site.layer not in layers.get(site.target, ()):
                layers[site.target] = (*layers.get(site.target, ()), site.layer)
    return layers


# target -> the model layers that run it (where a preset knows them): a model with none of them never calls it.
LAYERS: dict[str, tuple[str, ...]] = _layers()


def expand(names: list[str] | tuple[str, ...]) -> list[str]:
    """Replace preset names by their targets; other entries are returned as they are (deduplicated)."""
    out: list[str] = []
    for name in names:
        for target in ([site.target for site in PRESETS[name]] if name in PRESETS else [name]):
            if target not in out:
                out.append(target)
    return out


__all__ = ["ENGINE_MEMORY", "LAYERS", "MODEL_LOADED", "PRESETS", "PresetSite", "expand"]
