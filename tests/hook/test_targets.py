"""Targets: parsing, install/uninstall identity, import-time install, missing modules and attributes."""

from __future__ import annotations

import importlib
import logging
import sys
import uuid

import pytest
from prometheus_client import CollectorRegistry

import telemetry
from telemetry.hook import parse_target, parse_targets
from telemetry.hook.targets import Target

SOURCE = """
calls = []

def f(x):
    return x + 1

class C:
    def m(self, y):
        return y * 2

    @staticmethod
    def s(z):
        return z - 1

    @classmethod
    def c(cls, w):
        return (cls.__name__, w)
"""


def calls_total(registry, site):
    return registry.get_sample_value("memtel_hook_calls_total", {"site": site, "rank": "0",
                                                                 "node": _node()})


def _node():
    import socket
    return socket.gethostname()


@pytest.mark.parametrize("text, expected", [
    ("pkg.mod:func", Target("pkg.mod", "func")),
    ("  pkg.mod:Class.method ", Target("pkg.mod", "Class.method")),
    ("mod:_private", Target("mod", "_private")),
])
def test_parse_target_accepts_the_two_forms(text, expected):
    assert parse_target(text) == expected
    assert str(parse_target(text)) == text.strip()


@pytest.mark.parametrize("text", ["pkg.mod", "pkg.mod:", ":func", "pkg mod:f", "pkg.mod:A.b.c", "pkg..mod:f",
                                  "pkg.mod:f()", "1pkg:f", "pkg.mod::f", 42, None])
def test_malformed_target_raises_value_error_showing_the_expected_form(text):
    with pytest.raises(ValueError) as error:
        parse_target(text)
    assert '"package.module:function" or "package.module:Class.method"' in str(error.value)


def test_parse_targets_expands_presets_and_rejects_unknown_names():
    names = [t.name for t in parse_targets("lab-indexer, pkg.mod:f ,")]
    assert names == ["telemetry.model.indexer.launch:indexer_logits_launch", "pkg.mod:f"]
    with pytest.raises(ValueError, match=r"unknown hook target or preset 'vllm-sparse-indexr'.*vllm-sparse-indexer"):
        parse_targets("vllm-sparse-indexr")
    with pytest.raises(ValueError, match="no hook targets given"):
        parse_targets(" , ")


def test_malformed_target_in_install_raises_before_anything_is_patched(make_module):
    name = make_module(SOURCE)
    module = importlib.import_module(name)
    original = module.f
    with pytest.raises(ValueError, match="expected"):
        telemetry.install([f"{name}:f", f"{name}.f"], port=None)
    assert module.f is original
    handle = telemetry.hook.active_handle()
    assert handle is None or not handle.installed


def test_install_and_uninstall_restore_the_original_objects_exactly(make_module):
    name = make_module(SOURCE)
    module = importlib.import_module(name)
    before = {key: module.C.__dict__[key] for key in ("m", "s", "c")}
    f_before = module.f
    registry = CollectorRegistry()
    handle = telemetry.install([f"{name}:f", f"{name}:C.m", f"{name}:C.s", f"{name}:C.c"], port=None,
                               registry=registry)
    assert sorted(handle.installed) == sorted([f"{name}:f", f"{name}:C.m", f"{name}:C.s", f"{name}:C.c"])
    assert module.f is not f_before and module.f.__wrapped__ is f_before
    assert module.f.__name__ == "f"
    # Methods still bind as before: instance method, staticmethod, classmethod.
    assert module.f(1) == 2
    assert module.C().m(3) == 6
    assert module.C.s(5) == 4 and module.C().s(5) == 4
    assert module.C.c(7) == ("C", 7)
    assert isinstance(module.C.__dict__["s"], staticmethod) and isinstance(module.C.__dict__["c"], classmethod)
    for site in ("f", "C.m", "C.c"):
        assert calls_total(registry, f"{name}:{site}") == 1
    assert calls_total(registry, f"{name}:C.s") == 2
    handle.uninstall()
    assert module.f is f_before
    for key, value in before.items():
        assert module.C.__dict__[key] is value
    assert module.f(1) == 2
    assert calls_total(registry, f"{name}:f") is None  # collector unregistered with the hook


def test_installing_twice_is_a_no_op(make_module):
    name = make_module(SOURCE)
    module = importlib.import_module(name)
    registry = CollectorRegistry()
    first = telemetry.install([f"{name}:f"], port=None, registry=registry)
    wrapper = module.f
    second = telemetry.install(f"{name}:f", port=None)
    assert second is first and module.f is wrapper
    module.f(1)
    assert calls_total(registry, f"{name}:f") == 1
    first.uninstall()
    assert module.f is wrapper.__wrapped__


def test_target_of_a_module_not_imported_yet_is_installed_when_it_is_imported(make_module):
    package = "memtel_pkg_" + uuid.uuid4().hex[:8]
    name = make_module(SOURCE, package=package)
    registry = CollectorRegistry()
    handle = telemetry.install([f"{name}:f", f"{name}:C.m"], port=None, registry=registry)
    assert name not in sys.modules and package not in sys.modules  # nothing imported by install
    assert sorted(handle.pending) == sorted([f"{name}:f", f"{name}:C.m"])
    module = importlib.import_module(name)
    assert handle.pending == [] and sorted(handle.installed) == sorted([f"{name}:f", f"{name}:C.m"])
    assert module.f(1) == 2 and module.C().m(2) == 4
    assert calls_total(registry, f"{name}:f") == 1
    # The module keeps its own loader: the import hook's proxy does not leak.
    assert type(module.__loader__).__name__ == "SourceFileLoader"
    assert module.__spec__ is not None and type(module.__spec__.loader).__name__ == "SourceFileLoader"
    original = module.f.__wrapped__
    handle.uninstall()
    assert module.f is original
    assert all(type(f).__name__ != "ImportWatcher" for f in sys.meta_path)


def test_missing_module_and_attribute_are_a_warning_and_a_metric_never_a_crash(make_module, caplog):
    package = "memtel_pkg_" + uuid.uuid4().hex[:8]
    name = make_module(SOURCE, package=package)
    registry = CollectorRegistry()
    caplog.set_level(logging.WARNING, logger="memtel.hook")
    handle = telemetry.install([
        "memtel_no_such_package.mod:f",             # top-level package missing: known at once
        f"{package}.no_such_module:f",              # parent not imported yet: known when it is
        f"{name}:no_such_function",                 # attribute missing: known when the module loads
        f"{name}:C.no_such_method",
        f"{name}:NoSuchClass.m",
        f"{name}:calls",                            # not callable
    ], port=None, registry=registry)
    assert handle.failed == {"memtel_no_such_package.mod:f": "module_not_found"}
    importlib.import_module(name)  # imports the package too
    assert handle.failed == {
        "memtel_no_such_package.mod:f": "module_not_found",
        f"{package}.no_such_module:f": "module_not_found",
        f"{name}:no_such_function": "attribute_not_found",
        f"{name}:C.no_such_method": "attribute_not_found",
        f"{name}:NoSuchClass.m": "attribute_not_found",
        f"{name}:calls": "not_callable",
    }
    assert handle.pending == []
    # A module not found is still watched (sys.path may change: issue 19 item 8); it is a failure, with its
    # warning line, only when it was never imported by the process's exit (what atexit runs).
    messages = [r.getMessage() for r in caplog.records if r.name == "memtel.hook"]
    assert len(messages) == 4 and not any("module_not_found" in m for m in messages)
    for target, reason in handle.failed.items():
        assert registry.get_sample_value("memtel_hook_install_failures_total",
                                         {"target": target, "reason": reason, "rank": "0", "node": _node()}) == (
            None if reason == "module_not_found" else 1)
    failed = handle.failed
    handle._session._at_exit()  # counted now (the exporter is stopped at exit: read from the state)
    assert {target: handle.state.install_failures[(target, reason)] for target, reason in failed.items()} == \
        dict.fromkeys(failed, 1)
    messages = [r.getMessage() for r in caplog.records if r.name == "memtel.hook"]
    assert len(messages) == 6 and all("hook target not installed" in m for m in messages)
    assert any("no module named 'memtel_no_such_package.mod'" in m for m in messages)


def test_method_inherited_from_a_base_class_is_reported_not_patched_in_the_subclass(make_module):
    name = make_module(SOURCE + "\nclass D(C):\n    pass\n")
    module = importlib.import_module(name)
    handle = telemetry.install([f"{name}:D.m"], port=None)
    assert handle.failed == {f"{name}:D.m": "attribute_not_found"}
    assert "m" not in module.D.__dict__


def test_a_name_imported_from_a_hooked_module_is_wrapped_once_per_call_site(make_module):
    # vllm.utils.deep_gemm:fp8_fp4_mqa_logits is hooked, then sparse_attn_indexer imports the
    # (wrapped) name and is hooked itself: one record per call, under the caller's site.
    defining = make_module("def logits(x):\n    return x * 3\n")
    caller = make_module(f"from {defining} import logits\n\ndef run(x):\n    return logits(x)\n")
    registry = CollectorRegistry()
    handle = telemetry.install([f"{defining}:logits", f"{caller}:logits"], port=None, registry=registry)
    defining_module = importlib.import_module(defining)
    caller_module = importlib.import_module(caller)
    assert caller_module.run(2) == 6
    assert calls_total(registry, f"{caller}:logits") == 1
    assert calls_total(registry, f"{defining}:logits") is None
    defining_module.logits(1)
    assert calls_total(registry, f"{defining}:logits") == 1
    original = defining_module.logits.__wrapped__
    handle.uninstall()
    assert caller_module.logits is original and defining_module.logits is original
