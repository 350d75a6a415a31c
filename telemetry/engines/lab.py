"""The lab server (`memtel lab serve`, harness/labserver): its hook preset; its memory and workload come from it.

Its ranks run the indexer's launch loop (telemetry/model/indexer) on the allocator simulator or on CUDA: the
preset hooks the one logits launch. It needs no signal and no reader here: a rank feeds the hook its
simulator's counters as an allocator source (docs/architecture.md, "Allocator source") and tells the live
forecast its workload itself (`set_forecast_workload`: the `program` source).
"""

from __future__ import annotations

from telemetry.engines.registry import Engine, PresetSite, register

PRESETS: dict[str, tuple[PresetSite, ...]] = {
    # The lab server's stand-in for the indexer (telemetry/model/indexer/launch.py): one call per logits launch.
    "lab-indexer": (
        PresetSite(
            target="telemetry.model.indexer.launch:indexer_logits_launch",
            call_sites=("telemetry.model.indexer.backends",),
            lookup="module attribute",
            why="the launch backends of the lab server, `memtel replay` and the demo call it as "
                "`indexer.indexer_logits_launch` once per logits launch (docs/architecture.md)",
        ),
    ),
}

ENGINE = register(Engine(name="lab", title="the lab server", order=30, presets=PRESETS,
                         serve=("memtel", "lab", "serve", "--model-name", "{model}", "--host", "{host}", "--port",
                                "{port}")))

__all__ = ["ENGINE", "PRESETS"]
