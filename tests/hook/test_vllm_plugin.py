"""The vLLM plugin's configuration: MEMTEL_* parsing, one clear line on bad values, no heavy imports."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from telemetry import vllm_plugin
from telemetry.hook import active_handle
from telemetry.vllm_plugin import config_from_env, register

ROOT = Path(__file__).resolve().parents[2]


def test_off_unless_targets_are_set():
    assert config_from_env({}) is None
    assert config_from_env({"MEMTEL_TARGETS": "  "}) is None
    assert config_from_env({"MEMTEL_TARGETS": "a.b:c", "MEMTEL_ENABLE": "off"}) is None


def test_defaults_and_presets(tmp_path):
    config = config_from_env({"MEMTEL_TARGETS": "vllm-sparse-indexer, pkg.mod:Cls.meth"})
    assert config.targets == ("vllm.model_executor.layers.sparse_attn_indexer:fp8_fp4_mqa_logits",
                              "vllm.utils.deep_gemm:fp8_fp4_mqa_logits", "pkg.mod:Cls.meth")
    assert config.port == 9200 and config.log_dir is None and config.addr == "0.0.0.0"
    assert config.record_shape is False
    log_dir = tmp_path / "new" / "logs"
    config = config_from_env({"MEMTEL_TARGETS": "a.b:c", "MEMTEL_PORT": "9300", "MEMTEL_LOG_DIR": str(log_dir),
                              "MEMTEL_ENABLE": "YES", "MEMTEL_RECORD_SHAPE": "1"})
    assert (config.port, config.log_dir, config.record_shape) == (9300, str(log_dir), True)
    assert log_dir.is_dir()
    assert config_from_env({"MEMTEL_TARGETS": "a.b:c", "MEMTEL_PORT": "off"}).port is None


@pytest.mark.parametrize("env, message", [
    ({"MEMTEL_TARGETS": "a.b"}, "MEMTEL_TARGETS: unknown hook target or preset 'a.b'"),
    ({"MEMTEL_TARGETS": "a.b:c:d"}, "MEMTEL_TARGETS: malformed hook target 'a.b:c:d'"),
    ({"MEMTEL_TARGETS": "a.b:c", "MEMTEL_PORT": "92OO"}, "MEMTEL_PORT='92OO' is not a port"),
    ({"MEMTEL_TARGETS": "a.b:c", "MEMTEL_PORT": "70000"}, "MEMTEL_PORT='70000' is not a port"),
    ({"MEMTEL_TARGETS": "a.b:c", "MEMTEL_ENABLE": "maybe"}, "MEMTEL_ENABLE='maybe' is not a boolean"),
    ({"MEMTEL_ENABLE": "1"}, "MEMTEL_ENABLE is on but MEMTEL_TARGETS is empty"),
    ({"MEMTEL_TARGETS": "a.b:c", "MEMTEL_LOG_DIR": "/proc/version"}, "exists and is not a directory"),
    ({"MEMTEL_TARGETS": "a.b:c", "MEMTEL_LOG_DIR": "/proc/memtel-nope"}, "cannot be created"),
])
def test_bad_values_are_one_clear_log_line_and_telemetry_off(env, message, caplog):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("'", "'")):
        config_from_env(env)
    caplog.set_level(logging.DEBUG)
    register(env)  # never raises
    lines = [r for r in caplog.records if r.name.startswith("memtel")]
    assert len(lines) == 1 and lines[0].levelno == logging.ERROR
    assert lines[0].getMessage().startswith("memtel telemetry off: ") and message in lines[0].getMessage()
    assert active_handle() is None


def test_register_installs_without_importing_torch_or_vllm(tmp_path):
    code = (
        "import sys, json\n"
        "from telemetry.vllm_plugin import register\n"
        "register()\n"
        "register()  # vLLM may load plugins more than once: a no-op\n"
        "from telemetry.hook import active_handle\n"
        "h = active_handle()\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm'))\n"
        "print(json.dumps({'heavy': heavy, 'pending': h.pending, 'installed': h.installed,\n"
        "                  'failed': h.failed, 'port': h.exporter_port}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MEMTEL_TARGETS": "vllm-sparse-indexer,json:dumps",
           "MEMTEL_LOG_DIR": str(tmp_path), "MEMTEL_PORT": "9999"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["heavy"] == []
    assert result["installed"] == ["json:dumps"]  # json is imported already: patched at once
    # vllm is not installed in this venv: the sparse-indexer targets fail as module_not_found, logged
    # (vLLM's own venv is exercised by test_vllm_real.py).
    assert result["failed"] == {
        "vllm.model_executor.layers.sparse_attn_indexer:fp8_fp4_mqa_logits": "module_not_found",
        "vllm.utils.deep_gemm:fp8_fp4_mqa_logits": "module_not_found",
    }
    assert result["pending"] == []
    assert result["port"] is None  # nothing hooked has run: no exporter


def test_plugin_module_imports_nothing_heavy():
    out = subprocess.run([sys.executable, "-c", "import sys, telemetry.vllm_plugin; "
                          "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'telemetry')))"],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['telemetry', 'telemetry.vllm_plugin']"
    assert vllm_plugin.register.__module__ == "telemetry.vllm_plugin"


def test_entry_point_is_declared():
    text = (ROOT / "pyproject.toml").read_text()
    assert '[project.entry-points."vllm.general_plugins"]' in text
    assert 'memtel = "telemetry.vllm_plugin:register"' in text
