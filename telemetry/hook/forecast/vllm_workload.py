"""The indexer workload of a vLLM worker, read when `Worker.load_model` returns (source `vllm`).

Where vLLM 0.32 keeps each value (checked against its source in .venv-vllm; tests/hook/test_forecast_vllm.py):
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
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from telemetry.hook.forecast.workload import VLLM, ForecastWorkload, make_workload

INDEXER_CLASSES = (
    "vllm.model_executor.layers.sparse_attn_indexer:SparseAttnIndexer",
    "vllm.models.glm5next.nvidia.sparse_indexer:SparseAttnIndexerKpool",
    "vllm.models.glm5next.amd.sparse_indexer:SparseAttnIndexerKpool",
)
FIXED_WIDTH_VARIABLE = "VLLM_SPARSE_INDEXER_FIXED_LOGITS_WIDTH"
BUDGET_VARIABLE = "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB"
DEFAULT_BUDGET_MIB = 512                 # vllm/envs.py's default
TP_ROW_SHARD_MIN_ROWS_PER_RANK = 16_384  # vllm/v1/attention/backends/mla/indexer.py, MIN_TP_SHARD_ROWS_PER_RANK


class NoIndexer(Exception):
    """The worker's model has no sparse-attention indexer: there is no indexer growth to forecast."""


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


def read_vllm_workload(worker: Any, environ: Mapping[str, str] = os.environ) -> ForecastWorkload:
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
    return make_workload(shape, mode=mode, source=VLLM, details=tuple(details))


__all__ = ["FIXED_WIDTH_VARIABLE", "INDEXER_CLASSES", "NoIndexer", "read_vllm_workload"]
