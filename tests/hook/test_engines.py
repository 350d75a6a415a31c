"""The serving engines (telemetry/engines): one module per engine, registered, and what the hook takes from them.

- Every module of telemetry/engines/ but the registry registers the engine named after it, and the hook's
  presets and signals are exactly the registered engines' (adding an engine is adding its file).
- A second registration of a name or of a preset is refused.
- The hook reads an engine's memory through the engine that recognises the worker: vLLM's `get_model()` and
  `model_runner.kv_caches`, SGLang's `model` and `token_to_kv_pool` buffers; a worker of neither shows nothing.
- An engine's command line: the lab server's parses with memtel's own parser.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from types import SimpleNamespace

import pytest

import telemetry.engines as engines_package
from telemetry.commands import registered_commands
from telemetry.engines import BY_NAME, ENGINES
from telemetry.engines.registry import Engine, register, serve_command
from telemetry.hook.engine import START_BEGIN_SIGNALS, STARTED_SIGNALS, kv_cache_tensors, model_of
from telemetry.hook.forecast.workload import ENGINE_SOURCES
from telemetry.hook.presets import ENGINE_MEMORY, MODEL_LOADED, PRESETS


def test_every_engine_module_registers_the_engine_named_after_it():
    modules = sorted(m.name for m in pkgutil.iter_modules(engines_package.__path__) if m.name != "registry")
    assert modules == sorted(BY_NAME), "a module of telemetry/engines/ that registers no engine (or another name)"
    for name in modules:
        assert importlib.import_module(f"telemetry.engines.{name}").ENGINE is BY_NAME[name]
    assert [engine.name for engine in ENGINES] == ["vllm", "sglang", "lab"]   # the order of every list
    assert {preset: sites for engine in ENGINES for preset, sites in engine.presets.items()} == PRESETS
    assert {e.name: e.model_loaded for e in ENGINES if e.model_loaded} == MODEL_LOADED
    assert {e.name: e.engine_memory for e in ENGINES if e.engine_memory} == ENGINE_MEMORY
    assert {e.name: e.start_begin for e in ENGINES if e.start_begin} == START_BEGIN_SIGNALS
    assert tuple(s for e in ENGINES for s in e.started) == STARTED_SIGNALS
    assert ENGINE_SOURCES == ("vllm",)   # the engines whose module reads the indexer workload


def test_a_name_or_a_preset_registered_twice_is_refused():
    with pytest.raises(ValueError, match="engine 'vllm' is registered twice"):
        register(Engine(name="vllm", title="vLLM again", order=99))
    with pytest.raises(ValueError, match=r"preset\(s\) lab-indexer already registered"):
        register(Engine(name="copy", title="a copy", order=99, presets={"lab-indexer": ()}))
    assert "copy" not in {engine.name for engine in importlib.import_module("telemetry.engines.registry").registered()}


class Tensor:
    """Stands in for a torch tensor: its storage's address and size."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.device = "cpu"
        self._storage = SimpleNamespace(data_ptr=lambda: address, nbytes=lambda: nbytes)

    def untyped_storage(self):
        return self._storage


def test_the_hook_reads_each_engines_memory_where_that_engine_keeps_it():
    weights, k, v, cache = object(), Tensor(1, 10), Tensor(2, 20), Tensor(3, 30)
    vllm = SimpleNamespace(get_model=lambda: weights, model_runner=SimpleNamespace(kv_caches=[cache, [k]]))
    assert model_of(vllm) is weights and kv_cache_tensors(vllm) == [cache, k]
    sglang = SimpleNamespace(model_runner=SimpleNamespace(model=weights,
                                                          token_to_kv_pool=SimpleNamespace(k_buffer=[k], v_buffer=[v])))
    assert model_of(sglang) is weights and kv_cache_tensors(sglang) == [k, v]
    neither = SimpleNamespace(model_runner=SimpleNamespace())
    assert model_of(neither) is None and kv_cache_tensors(neither) is None


def test_the_lab_servers_command_line_is_one_memtel_accepts():
    argv = serve_command(BY_NAME["lab"], "lab-model", "127.0.0.1", 8123, ["--arm", "fixed"])
    assert argv[0] == "memtel"
    parser = argparse.ArgumentParser(prog="memtel lab")   # the registered `memtel lab` command's own flags
    importlib.import_module(registered_commands()[argv[1]].module).configure(parser)
    args = parser.parse_args(argv[2:])
    assert (args.model_name, args.host, args.port, args.mode) == ("lab-model", "127.0.0.1", 8123, "fixed")
    assert serve_command(BY_NAME["vllm"], "M", "::1", 8000)[:3] == ["vllm", "serve", "M"]
    assert all(engine.serve for engine in ENGINES), "an engine without its command line"
