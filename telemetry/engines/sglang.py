"""SGLang (0.5.23): its hook presets, its signals, and how its memory is read.

Checked against SGLang's source from its wheel (sglang 0.5.23, with the DeepGEMM it pins, sgl-deep-gemm
0.2.3.post2), read with `ast`, never imported: tests/hook/test_presets_sglang.py.

Signals. Every scheduler's `ModelRunner.initialize` calls `self.load_model()`, which sets `self.model`: the model
is loaded when `ModelRunner.load_model` returns. `ModelRunner.initialize` loads the model, makes the KV pool
(token_to_kv_pool) and captures the graphs, so its return is the engine-memory signal and the end of the
start; read from its source, not run here. SGLang sizes the indexer's logits budget itself and has no
fixed-width switch: its workload is not read (the forecast uses MEMTEL_FORECAST_SHAPE or the reference).

The start (issue 38: SGLang's start paged MemtelUnifiedHeadroomFalling where vLLM's is explained). SGLang's
static memory (weights and KV pool) is `mem_fraction_static` of the memory available before the weights load:
`ModelRunner.init_torch_distributed` stores that figure (`pre_model_load_memory`, GiB, from
`get_available_gpu_memory`), and the KV pool is sized to leave `pre_model_load_memory * (1 -
mem_fraction_static)` free (sglang/srt/mem_cache/kv_cache_configurator.py, `_profile_available_bytes`). So the
start begins when `init_torch_distributed` returns, with a plan of `pre_model_load_memory *
mem_fraction_static`, and ends when `ModelRunner.initialize` returns, as vLLM's does between `init_device` and
warm-up (docs/alerts.md, "Falling").

What `memtel tune` sets: the chunk (`--chunked-prefill-size`) and the memory share (`--mem-fraction-static`). The
logits budget is sized from free memory (sglang/srt/layers/attention/mqa_logits_utils.py:
`SGLANG_DSA_MQA_LOGITS_FREE_MEM_FRACTION`, default 0.2, of the free memory, at most 0.3 of the device), so it is
no MiB setting and is not searched; only the stock width runs.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from telemetry.engines.registry import Applied, Engine, PresetSite, Tuning, register, tensors_in

if TYPE_CHECKING:
    from telemetry.model.fitsearch.space import Setting

PREFILL_PRESET = "sglang-sparse-indexer"
# Returns once SGLang knows what its start will hold (start_plan_bytes), before the weights load.
START_BEGIN = "sglang.srt.model_executor.model_runner:ModelRunner.init_torch_distributed"
BUDGET_VARIABLE = "SGLANG_DSA_MQA_LOGITS_FREE_MEM_FRACTION"

PRESETS: dict[str, tuple[PresetSite, ...]] = {
    # SGLang's sparse-attention indexers (sglang 0.5.23): the ragged prefill logits, float32 [rows, N] with N
    # the context so far, allocated inside DeepGEMM's fp8_mqa_logits (or the pure-torch fallback), per
    # row chunk of a prefill chunk, per layer. One target, deep_gemm's module attribute, serves the three
    # indexers that read it at call time; the targets of a preset that sit in modules never imported
    # (DeepSeek V4 code in a V3.2 server) stay pending and are reported as such.
    PREFILL_PRESET: (
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
}


def model(worker: Any) -> Any:
    """The model runner's `model` attribute (the worker's own, or its `model_runner`'s); None without."""
    runner = getattr(worker, "model_runner", None)
    return getattr(worker, "model", None) or getattr(runner, "model", None)


def kv_cache_tensors(worker: Any) -> list[Any] | None:
    """The KV pool's buffers (`token_to_kv_pool`: k_buffer, v_buffer or kv_buffer); None without."""
    pool = getattr(getattr(worker, "model_runner", worker), "token_to_kv_pool", None)
    if pool is None:
        return None
    buffers = [getattr(pool, name, None) for name in ("k_buffer", "v_buffer", "kv_buffer")]
    return list(tensors_in([b for b in buffers if b is not None])) or None


def start_plan_bytes(worker: Any, held_bytes: int | None) -> int | None:
    """What SGLang's start will hold once done, as it budgets it: `mem_fraction_static` of the memory available
    before its weights loaded (`pre_model_load_memory`, GiB). None where the runner shows neither."""
    available_gib = _number(getattr(worker, "pre_model_load_memory", None))
    fraction = _number(getattr(worker, "mem_fraction_static", None))
    if available_gib is None or fraction is None or not (0 < fraction <= 1 and 0 < available_gib < 1 << 24):
        return None   # a share of at most 16 PiB, or no plan
    return int(available_gib * fraction * (1 << 30))


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def tuned(setting: Setting, budget_mib: str) -> Applied:
    """`memtel tune`'s setting as SGLang's switches: the chunk; the budget is SGLang's own (a note says so)."""
    return Applied({}, ["--chunked-prefill-size", str(setting.chunk)],
                   [f"SGLang sizes the logits budget from free memory ({BUDGET_VARIABLE}); the search assumed "
                    f"{budget_mib} MiB"])


ENGINE = register(Engine(
    name="sglang", title="SGLang", order=20, presets=PRESETS, package="sglang",
    model_loaded=("sglang.srt.model_executor.model_runner:ModelRunner.load_model",),
    engine_memory=("sglang.srt.model_executor.model_runner:ModelRunner.initialize",
                   START_BEGIN),
    start_begin=(START_BEGIN,),
    started=("ModelRunner.initialize",),
    model=model, kv_cache=kv_cache_tensors, start_plan=start_plan_bytes,
    world="sglang.srt.distributed.parallel_state",   # a copy of vLLM's; its local rank is the scheduler's gpu_id
    serve=("python3", "-m", "sglang.launch_server", "--model-path", "{model}", "--host", "{host}", "--port", "{port}"),
    tuning=Tuning(PREFILL_PRESET, ("stock",), budget_is_setting=False, utilization_flag="--mem-fraction-static",
                  apply=tuned),
))

__all__ = ["BUDGET_VARIABLE", "ENGINE", "PREFILL_PRESET", "PRESETS", "START_BEGIN", "kv_cache_tensors", "model",
           "start_plan_bytes", "tuned"]
