"""The serving engines `memtel tune` writes settings for: their switches, and the lines to paste.

vLLM 0.32: the logits budget is `VLLM_SPARSE_INDEXER_MAX_LOGITS_MB`, the chunk `--max-num-batched-tokens`, the
memory share `--gpu-memory-utilization`; the fixed width is the patched build's switch
(`VLLM_SPARSE_INDEXER_FIXED_LOGITS_WIDTH=1`; telemetry/engines/vllm.py). SGLang 0.5.23: the chunk
is `--chunked-prefill-size` and the share `--mem-fraction-static`; it sizes the logits budget itself
(sglang/srt/layers/attention/mqa_logits_utils.py: `SGLANG_DSA_MQA_LOGITS_FREE_MEM_FRACTION` (default 0.2) of the
free memory, at most 0.3 of the device), so the budget is not a MiB setting there and is not searched; it has no
fixed-width switch. The lab server (`memtel lab serve`) takes all of them as flags.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from telemetry.engines.vllm import BUDGET_VARIABLE, FIXED_WIDTH_VARIABLE
from telemetry.errors import ConfigError
from telemetry.hook.presets import PRESETS
from telemetry.model.indexer.planner import MODES
from telemetry.model.indexer.shape import budget_mib_text
from telemetry.model.tune.space import Setting
from telemetry.model.tune.verify import ALLOC_CONF_VARIABLE

SGLANG_BUDGET_VARIABLE = "SGLANG_DSA_MQA_LOGITS_FREE_MEM_FRACTION"


@dataclass(frozen=True)
class Engine:
    name: str
    preset: str                   # the hook preset of its prefill logits (telemetry/hook/presets.py)
    modes: tuple[str, ...]        # the width modes it can run
    budget_is_setting: bool       # the logits budget is a MiB setting (searched)
    utilization_flag: str | None  # its share of the device's memory


ENGINES: dict[str, Engine] = {
    "vllm": Engine("vllm", "vllm-sparse-indexer", MODES, True, "--gpu-memory-utilization"),
    "sglang": Engine("sglang", "sglang-sparse-indexer", ("stock",), False, "--mem-fraction-static"),
    "lab": Engine("lab", "lab-indexer", MODES, True, None),
}


def engine_of_preset(name: str) -> Engine:
    """The engine whose prefill-logits preset is `name`; ConfigError for another preset."""
    for engine in ENGINES.values():
        if engine.preset == name:
            return engine
    if name in PRESETS:
        raise ConfigError(f"--preset {name}: not a prefill-logits preset (tune searches prefill settings); use one of "
                          + ", ".join(e.preset for e in ENGINES.values()))
    raise ConfigError(f"--preset {name!r}: unknown; the presets of the prefill logits are "
                      + ", ".join(e.preset for e in ENGINES.values()))


def apply_settings(engine: Engine, setting: Setting, utilization: float | None) -> dict[str, Any]:
    """What gives `setting` to the engine, for scripts and `memtel ab`'s `tune:` arms: {"env": {NAME: value},
    "flags": [engine flags], "notes": [what a setting cannot say]}."""
    env: dict[str, str] = {ALLOC_CONF_VARIABLE: setting.alloc_conf}
    notes: list[str] = []
    budget = budget_mib_text(setting.budget_bytes)
    flags: list[str]
    if engine.name == "vllm":
        env[BUDGET_VARIABLE] = budget
        if setting.mode == "fixed":
            env[FIXED_WIDTH_VARIABLE] = "1"
            notes.append(f"{FIXED_WIDTH_VARIABLE}=1 is the patched build's switch (vLLM 0.32 itself has none)")
        flags = ["--max-num-batched-tokens", str(setting.chunk)]
    elif engine.name == "sglang":
        notes.append(f"SGLang sizes the logits budget from free memory ({SGLANG_BUDGET_VARIABLE}); the search "
                     f"assumed {budget} MiB")
        flags = ["--chunked-prefill-size", str(setting.chunk)]
    else:
        flags = ["--arm", setting.mode, "--chunk", str(setting.chunk), "--budget-mb", budget]
        if setting.alloc_conf:
            flags += ["--alloc-conf", setting.alloc_conf]
    if utilization is not None and engine.utilization_flag:
        flags += [engine.utilization_flag, f"{utilization:.2f}"]
    return {"env": env, "flags": flags, "notes": notes}


COMMAND_HEADS = {"vllm": "vllm serve MODEL ...", "sglang": "python -m sglang.launch_server --model-path MODEL ...",
                 "lab": "memtel lab serve ..."}


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
    lines.append(" ".join([COMMAND_HEADS[engine.name], *map(shlex.quote, applied["flags"])]))
    return lines


__all__ = ["COMMAND_HEADS", "ENGINES", "Engine", "apply_settings", "engine_of_preset", "paste_lines"]
