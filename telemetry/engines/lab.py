"""The lab server (`memtel lab serve`, harness/labserver): its hook preset; its memory and workload come from it.

Its ranks run the indexer's launch loop (telemetry/model/indexer) on the allocator simulator or on CUDA: the
preset hooks the one logits launch. It needs no signal and no reader here: a rank feeds the hook its
simulator's counters as an allocator source (docs/architecture.md, "Allocator source") and tells the live
forecast its workload itself (`set_forecast_workload`: the `program` source). `memtel tune` sets every knob of
its workload as a flag (`--arm`, `--chunk`, `--budget-mb`, `--alloc-conf`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from telemetry.engines.registry import Applied, Engine, PresetSite, Tuning, register

if TYPE_CHECKING:
    from telemetry.model.fitsearch.space import Setting

PREFILL_PRESET = "lab-indexer"

PRESETS: dict[str, tuple[PresetSite, ...]] = {
    # The lab server's stand-in for the indexer (telemetry/model/indexer/launch.py): one call per logits launch.
    PREFILL_PRESET: (
        PresetSite(
            target="telemetry.model.indexer.launch:indexer_logits_launch",
            call_sites=("telemetry.model.indexer.backends",),
            lookup="module attribute",
            why="the launch backends of the lab server, `memtel replay` and the demo call it as "
                "`indexer.indexer_logits_launch` once per logits launch (docs/architecture.md)",
        ),
    ),
}


def tuned(setting: Setting, budget_mib: str) -> Applied:
    """`memtel tune`'s setting as the lab server's flags (it reads no variable of its own)."""
    flags = ["--arm", setting.mode, "--chunk", str(setting.chunk), "--budget-mb", budget_mib]
    if setting.alloc_conf:
        flags += ["--alloc-conf", setting.alloc_conf]
    return Applied({}, flags, [])


ENGINE = register(Engine(name="lab", title="the lab server", order=30, presets=PRESETS,
                         serve=("memtel", "lab", "serve", "--model-name", "{model}", "--host", "{host}", "--port",
                                "{port}"),
                         tuning=Tuning(PREFILL_PRESET, None, budget_is_setting=True, utilization_flag=None,
                                       apply=tuned)))

__all__ = ["ENGINE", "PREFILL_PRESET", "PRESETS", "tuned"]
