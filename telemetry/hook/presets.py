"""Named sets of hook targets, usable wherever a target is (`MEMTEL_TARGETS`, `install`).

Each site names the module attribute that its call site looks up *at call time*: patching a name
where it is defined does nothing for a module that imported it with `from ... import name` before
the patch, so the target is the attribute the caller actually reads. `call_sites` records which
module reads it and how; `layer` names the model layer whose forward makes those calls, so the hook
can tell, once the model is loaded, that a hooked function will never run in this model (vLLM imports
the indexer's modules in every worker, whatever the model). tests/hook/test_presets.py checks all
three against the installed source.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PresetSite:
    target: str                      # "package.module:name"
    call_sites: tuple[str, ...]      # modules whose functions call it, looking the name up at call time
    lookup: str                      # "module global" or "function-local import"
    why: str
    layer: str | None = None         # "package.module:Class": the model layer that runs these calls


PRESETS: dict[str, tuple[PresetSite, ...]] = {
    # vLLM's sparse-attention indexer (DeepSeek V3.2 / GLM DSA): the prefill logits, float32 [M, N]
    # with N the context so far: the allocation that adds a segment per prefill chunk.
    "vllm-sparse-indexer": (
        PresetSite(
            target="vllm.model_executor.layers.sparse_attn_indexer:fp8_fp4_mqa_logits",
            call_sites=("vllm.model_executor.layers.sparse_attn_indexer",),
            lookup="module global",
            why="sparse_attn_indexer() (the custom op's implementation, run eagerly also under "
                "torch.compile) calls the name imported at module level from vllm.utils.deep_gemm",
            layer="vllm.model_executor.layers.sparse_attn_indexer:SparseAttnIndexer",
        ),
        PresetSite(
            target="vllm.utils.deep_gemm:fp8_fp4_mqa_logits",
            call_sites=("vllm.models.glm5next.nvidia.sparse_indexer",),
            lookup="function-local import",
            why="the GLM kpool indexer imports the name from vllm.utils.deep_gemm inside its prefill "
                "function, so it reads the deep_gemm module attribute on every call",
            layer="vllm.models.glm5next.nvidia.sparse_indexer:SparseAttnIndexerKpool",
        ),
    ),
    # The decode path's paged logits ([batch, max_model_len]: fixed width, no growth per step);
    # a separate preset because it fires every decode step of every layer.
    "vllm-sparse-indexer-decode": (
        PresetSite(
            target="vllm.model_executor.layers.sparse_attn_indexer:fp8_fp4_paged_mqa_logits",
            call_sites=("vllm.model_executor.layers.sparse_attn_indexer",),
            lookup="module global",
            why="the decode branch of sparse_attn_indexer() calls the module-level import",
            layer="vllm.model_executor.layers.sparse_attn_indexer:SparseAttnIndexer",
        ),
        PresetSite(
            target="vllm.utils.deep_gemm:fp8_fp4_paged_mqa_logits",
            call_sites=("vllm.models.glm5next.nvidia.sparse_indexer",),
            lookup="function-local import",
            why="the GLM kpool indexer imports it inside its decode function",
            layer="vllm.models.glm5next.nvidia.sparse_indexer:SparseAttnIndexerKpool",
        ),
    ),
    # The lab server's stand-in for the indexer (harness/indexer/launch.py): one call per logits launch.
    "lab-indexer": (
        PresetSite(
            target="harness.indexer.launch:indexer_logits_launch",
            call_sites=("harness.indexer.launch",),
            lookup="module global",
            why="the lab server and `memtel replay` call it once per logits launch (docs/architecture.md)",
        ),
    ),
}


# Methods whose return means "the model is loaded" in a serving engine: the hook then reports targets
# that have not resolved (docs/hook.md, "Unresolved targets"). vLLM 0.32: every V1 worker loads the model
# through `Worker.load_model` (the CPU worker inherits it); checked by tests/hook/test_presets.py.
MODEL_LOADED: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm.v1.worker.gpu_worker:Worker.load_model",),
}


# target -> the model layer that runs it (where a preset knows it).
LAYERS: dict[str, str] = {site.target: site.layer for sites in PRESETS.values() for site in sites if site.layer}


def expand(names: list[str] | tuple[str, ...]) -> list[str]:
    """Replace preset names by their targets; other entries are returned as they are (deduplicated)."""
    out: list[str] = []
    for name in names:
        for target in ([site.target for site in PRESETS[name]] if name in PRESETS else [name]):
            if target not in out:
                out.append(target)
    return out
