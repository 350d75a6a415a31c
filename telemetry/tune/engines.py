"""The serving engines `memtel tune` writes settings for, and the lines to paste.

What each engine's switches are (its prefill-logits preset, its width modes, whether its logits budget is a
setting, its memory-share flag, how a setting becomes its variables and flags) is its own module's `Tuning`
(telemetry/engines/vllm.py, sglang.py, lab.py); this module only gathers the registered engines that declare one
and adds what every engine shares: the allocator's variable and the command line's head (the engine's `serve`).
"""

from __future__ import annotations

import shlex
from typing import Any

from telemetry.engines import ENGINES as REGISTERED
from telemetry.engines.registry import Engine, Tuning
from telemetry.errors import ConfigError
from telemetry.model.fitsearch.space import Setting
from telemetry.model.fitsearch.verify import ALLOC_CONF_VARIABLE
from telemetry.model.indexer.planner import MODES
from telemetry.model.indexer.shape import budget_mib_text

ENGINES: dict[str, Engine] = {engine.name: engine for engine in REGISTERED if engine.tuning is not None}


def tuning(engine: Engine) -> Tuning:
    """The engine's tuning (every engine of `ENGINES` has one)."""
    if engine.tuning is None:
        raise ValueError(f"engine {engine.name!r} declares no tuning")
    return engine.tuning


def modes(engine: Engine) -> tuple[str, ...]:
    """The width modes the engine has a switch for."""
    return tuning(engine).modes or MODES


def engine_of_preset(name: str) -> Engine:
    """The engine whose prefill-logits preset is `name`; ConfigError for another preset."""
    for engine in ENGINES.values():
        if tuning(engine).preset == name:
            return engine
    presets = ", ".join(tuning(e).preset for e in ENGINES.values())
    if any(name in engine.presets for engine in REGISTERED):
        raise ConfigError(f"--preset {name}: not a prefill-logits preset (tune searches prefill settings); use one of "
                          + presets)
    raise ConfigError(f"--preset {name!r}: unknown; the presets of the prefill logits are {presets}")


def apply_settings(engine: Engine, setting: Setting, utilization: float | None) -> dict[str, Any]:
    """What gives `setting` to the engine, for scripts and `memtel ab`'s `tune:` arms: {"env": {NAME: value},
    "flags": [engine flags], "notes": [what a setting cannot say]}."""
    switches = tuning(engine)
    applied = switches.apply(setting, budget_mib_text(setting.budget_bytes))
    env = {ALLOC_CONF_VARIABLE: setting.alloc_conf, **applied.env}
    flags = list(applied.flags)
    if utilization is not None and switches.utilization_flag:
        flags += [switches.utilization_flag, f"{utilization:.2f}"]
    return {"env": env, "flags": flags, "notes": list(applied.notes)}


def command_head(engine: Engine) -> str:
    """The engine's command line up to its model, then `...`: `vllm serve MODEL ...`."""
    words = engine.serve[:engine.serve.index("{model}") + 1] if "{model}" in engine.serve else engine.serve
    return " ".join("MODEL" if word == "{model}" else word for word in words) + " ..."


def paste_lines(engine: Engine, setting: Setting, utilization: float | None) -> list[str]:
    """The environment and the engine's command line that give `setting` (comments say what a line cannot)."""
    applied = apply_settings(engine, setting, utilization)
    lines = []
    for name, value in applied["env"].items():
        if name == ALLOC_CONF_VARIABLE and not value:
            lines.append(f"unset {ALLOC_CONF_VARIABLE} PYTORCH_ALLOC_CONF   # the allocator's defaults")
        else:
            lines.append(f"export {name}={shlex.quote(value)}")
    lines += [f"# {note}" for note in applied["notes"]]
    lines.append(" ".join([command_head(engine), *map(shlex.quote, applied["flags"])]))
    return lines


__all__ = ["ENGINES", "apply_settings", "command_head", "engine_of_preset", "modes", "paste_lines", "tuning"]
