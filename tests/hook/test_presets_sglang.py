"""The SGLang presets against SGLang's real source: sglang 0.5.23 and the DeepGEMM it pins (sgl-deep-gemm 0.2.3.post2).

The wheels come from pip's index (tests/support/sglang_source.py) and are read with `ast`, never installed
or imported (SGLang needs CUDA). For each preset site this proves: the target's module defines the name;
each call site reads it at call time with the site's lookup (a module global, `module.name` on an imported
module, or `from module import name [as alias]` inside the function); and the site's layer class exists and
reaches one of those reads through the calls it makes. A rename upstream fails here rather than hooking
nothing. Also checked: the model-loaded signal (ModelRunner.load_model sets `self.model`) and the world
group the hook reads the rank from (telemetry/hook/rank.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from telemetry.engines.registry import HEALTH_PATH, MODELS_PATH
from telemetry.hook.presets import LAYERS, MODEL_LOADED, PRESETS, PresetSite
from telemetry.hook.rank import ENGINE_WORLDS
from telemetry.hook.targets import parse_target
from tests.support import sglang_source as sglang
from tests.support.python_source import (
    Function,
    attribute_reads,
    called_names,
    classes,
    functions,
    local_from_imports,
    local_names,
    module_aliases,
    module_level_names,
    name_reads,
)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.network

SITES = [(preset, site) for preset, sites in PRESETS.items() if preset.startswith("sglang") for site in sites]
IDS = [f"{preset}:{site.target}<-{site.call_sites[0]}" for preset, site in SITES]


def top_level_aliases(tree: ast.Module, module: str) -> set[str]:
    """`import <module>` at the module's top level (in try/if blocks too), not inside functions or classes."""
    top = [node for node in tree.body if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return module_aliases(ast.Module(body=top, type_ignores=[]), module)


def reads_at_call_time(site: PresetSite, caller: str) -> list[Function]:
    """The functions of `caller` that read the site's target at call time, by the site's lookup."""
    target = parse_target(site.target)
    tree = sglang.tree(caller)
    proven = []
    for function in functions(tree):
        if site.lookup == "module global":
            defined_here = caller == target.module and target.qualname in module_level_names(tree)
            imported = any(isinstance(n, ast.ImportFrom) and n.module == target.module
                           and any(a.name == target.qualname and a.asname is None for a in n.names) for n in tree.body)
            if (name_reads(function, target.qualname) and target.qualname not in local_names(function)
                    and (defined_here or imported)):
                proven.append(function)
        elif site.lookup == "module attribute":
            aliases = top_level_aliases(tree, target.module) | module_aliases(function, target.module)
            if attribute_reads(function, aliases, target.qualname):
                proven.append(function)
        elif site.lookup == "function-local import":
            bound = local_from_imports(function, target.module, target.qualname)
            if any(name_reads(function, name) for name in bound):
                proven.append(function)
        else:
            pytest.fail(f"unknown lookup kind {site.lookup!r} for {site.target}")
    return proven


def test_the_sglang_presets_name_the_indexer_logits_of_each_indexer():
    prefill = {(s.target, s.layer) for s in PRESETS["sglang-sparse-indexer"]}
    indexer, kpool, c4 = (f"sglang.srt.layers.attention.{m}" for m in
                          ("dsa.dsa_indexer:Indexer", "dsa.dsa_indexer_kpool:IndexerKPool", "dsv4.indexer:C4Indexer"))
    assert {("deep_gemm:fp8_mqa_logits", layer) for layer in (indexer, kpool, c4)} <= prefill
    paged = {s.target for s in PRESETS["sglang-sparse-indexer-paged"]}
    assert paged == {"deep_gemm:fp8_paged_mqa_logits", "deep_gemm:fp8_fp4_paged_mqa_logits"}
    assert set(LAYERS["deep_gemm:fp8_mqa_logits"]) == {indexer, kpool, c4}


@pytest.mark.parametrize("preset, site", SITES, ids=IDS)
def test_sglang_target_exists_and_is_read_at_call_time(preset, site):
    target = parse_target(site.target)
    defining = sglang.tree(target.module)
    assert target.qualname in module_level_names(defining), (
        f"{site.target}: {target.module} ({sglang.wheel(sglang.distribution_of(target.module)).name}) does not "
        f"define {target.qualname!r} at module level")
    for caller in site.call_sites:
        proven = reads_at_call_time(site, caller)
        assert proven, (f"{preset}: no function of {caller} reads {site.target} with a {site.lookup} lookup in "
                        f"sglang {sglang.SGLANG_VERSION}: the preset would not fire")
        cached = [f.name for f in proven if any("lru_cache" in ast.unparse(d) for d in f.decorator_list)]
        if cached:  # read once, on the first call: the site's explanation must say so (docs/hook.md does)
            assert "once" in site.why, (preset, site.target, cached)


@pytest.mark.parametrize("preset, site", SITES, ids=IDS)
def test_sglang_layer_exists_and_reaches_the_read(preset, site):
    # The unresolved check calls a target "not in the model" when the model has none of its layers: each
    # layer must exist and its own calls must lead to one of the reads.
    assert site.layer is not None, f"{preset}: {site.target} names no layer"
    module, _, name = site.layer.partition(":")
    layer_class = classes(sglang.tree(module)).get(name)
    assert layer_class is not None, f"{preset}: {site.layer} does not exist in sglang {sglang.SGLANG_VERSION}"
    proven = [f for caller in site.call_sites for f in reads_at_call_time(site, caller)]
    # One step out: the call sites' functions that call a reading function (an engine calls the backend's
    # indexer method, which calls the reading one). Not further: names like `forward` would match anything.
    names = {f.name for f in proven}
    reach = names | {f.name for caller in site.call_sites for f in functions(sglang.tree(caller))
                     if called_names(f) & names}
    inside = {id(node) for node in ast.walk(layer_class)}
    assert any(id(f) in inside for f in proven) or called_names(layer_class) & reach, (
        f"{preset}: {site.layer} neither defines nor calls a function that reads {site.target} ({sorted(reach)})")


def test_the_sglang_model_loaded_signal_sets_the_model_the_layer_check_reads():
    (signal,) = MODEL_LOADED["sglang"]
    target = parse_target(signal)
    class_name, method = target.qualname.split(".")
    runner = classes(sglang.tree(target.module))[class_name]
    methods = {f.name: f for f in runner.body if isinstance(f, ast.FunctionDef)}
    assert method in methods, f"{target.module}.{class_name} has no {method}"
    # The hook reads the model from the runner's `model` attribute (it has no get_model()) ...
    assigned = {t.attr for node in ast.walk(methods[method]) if isinstance(node, ast.Assign) for t in node.targets
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    assert "model" in assigned and "get_model" not in methods
    # ... and the runner loads it through the class attribute, so the patched method runs.
    calls = [node for node in ast.walk(methods["initialize"]) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == method
             and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"]
    assert calls, f"{class_name}.initialize does not call self.{method}()"


def test_the_sglang_world_group_gives_rank_and_the_gpu_as_local_rank():
    # rank.py reads `_WORLD.rank` / `_WORLD.local_rank` from SGLang's parallel state; the scheduler
    # initializes it with local_rank = its gpu_id, so the exporter port is MEMTEL_PORT + gpu_id.
    (module,) = [m for engine, m in ENGINE_WORLDS if engine == "sglang"]
    state = sglang.tree(module)
    assert "_WORLD" in module_level_names(state)
    init = {f.name: f for f in classes(state)["GroupCoordinator"].body if isinstance(f, ast.FunctionDef)}["__init__"]
    assigned = {t.attr for node in ast.walk(init) if isinstance(node, (ast.Assign, ast.AnnAssign))
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    assert {"rank", "local_rank"} <= assigned
    bootstrap = sglang.tree("sglang.srt.distributed.bootstrap")
    local_ranks = [ast.unparse(k.value) for node in ast.walk(bootstrap) if isinstance(node, ast.Call)
                   and getattr(node.func, "id", None) == "init_distributed_environment"
                   for k in node.keywords if k.arg == "local_rank"]
    assert local_ranks == ["gpu_id"], local_ranks


def test_the_pins_agree_sglang_requires_the_deep_gemm_checked_here():
    requires = [line.split(":", 1)[1].strip() for line in sglang.metadata("sglang").splitlines()
                if line.startswith("Requires-Dist:")]
    assert f"sgl-deep-gemm=={sglang.DEEP_GEMM_VERSION}" in requires
    assert f"sglang {sglang.SGLANG_VERSION}" in (ROOT / "telemetry/engines/sglang.py").read_text()
    assert f"sglang {sglang.SGLANG_VERSION}" in (ROOT / "docs/hook.md").read_text()


def test_sglang_answers_what_the_ab_runner_asks_of_an_engine():
    """HEALTH_PATH and MODELS_PATH (telemetry/engines/registry.py): SGLang's HTTP server routes both, and its model
    cards carry max_model_len (harness/ab/lifecycle.py reads it)."""
    server = sglang.source("sglang.srt.entrypoints.http_server")
    assert f'@app.get("{HEALTH_PATH}")' in server and f'@app.get("{MODELS_PATH}"' in server
    assert "max_model_len=" in server
    protocol = sglang.tree("sglang.srt.entrypoints.openai.protocol")
    card = next(n for n in ast.walk(protocol) if isinstance(n, ast.ClassDef) and n.name == "ModelCard")
    assert "max_model_len" in {n.target.id for n in card.body if isinstance(n, ast.AnnAssign)
                               and isinstance(n.target, ast.Name)}
