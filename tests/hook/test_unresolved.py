"""The hook says what it does (issue 14): one announcement per process, and targets that never resolved.

Found by a new user: with `MEMTEL_TARGETS=vllm-sparse-indexer` on a model without that indexer there was
no exporter, no log file and no log line, and a working hook said nothing either.
"""

from __future__ import annotations

import importlib
import socket
import time
import uuid
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

import telemetry
from tests.support.ports import free_port

NODE = socket.gethostname()
WORKER = """
class Worker:
    def load_model(self, fail=False):
        if fail:
            raise RuntimeError("weights missing")
        return "loaded"
"""


def announcements(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("memtel hook on")]


def unresolved_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "hook targets not resolved" in r.getMessage()]


def gauge(registry, target):
    return registry.get_sample_value("memtel_hook_unresolved_targets", {"target": target, "rank": "0", "node": NODE})


def test_the_hook_announces_itself_once_per_process(make_module, tmp_path, caplog):
    caplog.set_level("INFO", logger="memtel")
    name = make_module("def f(x):\n    return x\n")
    module = importlib.import_module(name)
    port = free_port()
    handle = telemetry.install([f"{name}:f", "memtel_no_such_package.mod:g"], port=port, addr="127.0.0.1",
                               log_dir=tmp_path)
    assert announcements(caplog) == []   # installed, nothing run: nothing to say yet
    for i in range(3):
        module.f(i)
    (line,) = announcements(caplog)
    assert f"hooked: {name}:f;" in line and "rank 0 (local rank 0, from default)" in line
    assert "unresolved: memtel_no_such_package.mod:g" in line
    assert f"exporter: http://127.0.0.1:{port}/metrics" in line and f"call log: {handle.log_path}" in line
    assert [r.name for r in caplog.records if r.getMessage() == line] == ["memtel.hook"]


def test_the_announcement_says_https_when_the_web_config_has_tls(make_module, tmp_path, caplog):
    import ssl

    from tests.support.certs import make_certs

    certs = make_certs(tmp_path / "certs")
    config = tmp_path / "web.yml"
    config.write_text(f"tls_server_config:\n  cert_file: {certs.server_cert}\n  key_file: {certs.server_key}\n")
    caplog.set_level("INFO", logger="memtel")
    name = make_module("def f(x):\n    return x\n")
    module = importlib.import_module(name)
    port = free_port()
    telemetry.install([f"{name}:f"], port=port, addr="127.0.0.1", web_config=str(config))
    module.f(1)
    (line,) = announcements(caplog)
    assert f"exporter: https://127.0.0.1:{port}/metrics" in line, line
    context = ssl.create_default_context(cafile=str(certs.ca))
    assert httpx.get(f"https://127.0.0.1:{port}/metrics", verify=context, timeout=5).status_code == 200


def test_targets_configured_but_none_resolved_still_say_so(make_module, tmp_path, caplog):
    caplog.set_level("INFO", logger="memtel")
    package = "memtel_pkg_" + uuid.uuid4().hex[:8]
    never_imported = make_module("def g(x):\n    return x\n", package=package)
    port = free_port()
    targets = ["memtel_no_such_package.mod:f", f"{never_imported}:g"]
    handle = telemetry.install(targets, port=port, addr="127.0.0.1", log_dir=tmp_path / "logs",
                               unresolved_after_s=0.3)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not announcements(caplog):   # the announcement ends the start
        time.sleep(0.05)
    (warning,) = unresolved_warnings(caplog)
    assert warning.startswith("memtel: 2 of 2 hook targets not resolved 0.3 s after install in pid ")
    assert "memtel_no_such_package.mod:f (no such module)" in warning
    assert f"{never_imported}:g (its module was never imported)" in warning
    (line,) = announcements(caplog)
    assert "hooked: none;" in line and f"exporter: http://127.0.0.1:{port}/metrics" in line
    # Seen on the exporter although nothing was ever recorded; the (empty) log file says the hook is on.
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for target in targets:
        assert f'memtel_hook_unresolved_targets{{node="{NODE}",rank="0",target="{target}"}} 1.0' in text
    assert Path(handle.log_path).read_text() == ""


def test_the_model_loaded_signal_reports_unresolved_targets_once(make_module, caplog):
    caplog.set_level("INFO", logger="memtel")
    loader = importlib.import_module(make_module(WORKER))
    package = "memtel_pkg_" + uuid.uuid4().hex[:8]
    later = make_module("def g(x):\n    return x\n", package=package)
    registry = CollectorRegistry()
    handle = telemetry.install([f"{later}:g"], port=None, registry=registry, unresolved_after_s=None,
                               model_loaded=[f"{loader.__name__}:Worker.load_model"])
    assert handle.installed == [] and handle.pending == [f"{later}:g"]  # the signal is not a hook target
    assert gauge(registry, f"{later}:g") is None                      # not checked yet: absent, not 0
    with pytest.raises(RuntimeError, match="weights missing"):
        loader.Worker().load_model(fail=True)                           # a failed load checks nothing
    assert unresolved_warnings(caplog) == []
    assert loader.Worker().load_model() == "loaded"
    (warning,) = unresolved_warnings(caplog)
    assert "1 of 1 hook targets not resolved after the model loaded" in warning
    assert gauge(registry, f"{later}:g") == 1
    loader.Worker().load_model()                                        # a second load: no second warning
    assert len(unresolved_warnings(caplog)) == 1 and len(announcements(caplog)) == 1
    module = importlib.import_module(later)                             # resolves late: the gauge follows
    assert gauge(registry, f"{later}:g") == 0 and module.g(3) == 3
    original = loader.Worker.__dict__["load_model"].__wrapped__
    handle.uninstall()
    assert loader.Worker.__dict__["load_model"] is original


def test_resolved_targets_give_no_warning_at_the_check(make_module, caplog):
    caplog.set_level("INFO", logger="memtel")
    name = make_module("def f(x):\n    return x\n")
    importlib.import_module(name)
    registry = CollectorRegistry()
    handle = telemetry.install([f"{name}:f"], port=None, registry=registry)
    assert handle.check_unresolved() == {}
    assert unresolved_warnings(caplog) == [] and len(announcements(caplog)) == 1
    assert gauge(registry, f"{name}:f") == 0


LAYERED = """
class IndexerLayer:
    def forward(self, x):
        return logits(x)

class OtherLayer:
    pass

def logits(x):
    return x * 2
"""

ENGINE = """
class Model:
    def __init__(self, layers):
        self.layers = layers

    def modules(self):
        return iter([self, *self.layers])

class Worker:
    layers = []

    def load_model(self):
        self.model = Model(self.layers)

    def get_model(self):
        return self.model
"""


@pytest.mark.parametrize("has_layer", [False, True])
def test_a_hooked_target_whose_layer_is_not_in_the_loaded_model_is_unresolved(make_module, monkeypatch, caplog,
                                                                             has_layer):
    # vLLM imports the sparse indexer's modules in every worker, so its targets install even in a Llama;
    # the preset's layer (SparseAttnIndexer) is what the loaded model lacks.
    from telemetry.hook import presets

    caplog.set_level("INFO", logger="memtel")
    layers = importlib.import_module(make_module(LAYERED))
    engine = importlib.import_module(make_module(ENGINE))
    target = f"{layers.__name__}:logits"
    monkeypatch.setitem(presets.LAYERS, target, (f"{layers.__name__}:IndexerLayer",))
    engine.Worker.layers = [layers.OtherLayer()] + ([layers.IndexerLayer()] if has_layer else [])
    registry = CollectorRegistry()
    handle = telemetry.install([target], port=None, registry=registry, unresolved_after_s=None,
                               model_loaded=[f"{engine.__name__}:Worker.load_model"])
    assert handle.installed == [target]
    engine.Worker().load_model()
    if has_layer:
        assert unresolved_warnings(caplog) == [] and gauge(registry, target) == 0
        return
    (warning,) = unresolved_warnings(caplog)
    assert f"{target} (hooked, but the loaded model has no IndexerLayer layer: it never runs)" in warning
    assert gauge(registry, target) == 1 and handle.unresolved == {target: "not_in_model"} and handle.failed == {}
    assert "hooked: none; unresolved: " + target in announcements(caplog)[0]
    layers.IndexerLayer().forward(3)   # it ran after all: the gauge follows the facts
    assert gauge(registry, target) == 0
