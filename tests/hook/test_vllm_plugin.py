"""The vLLM plugin's configuration: MEMTEL_* parsing, one clear line on bad values, no heavy imports."""

from __future__ import annotations

import json
import logging
import os
import re
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
    assert not log_dir.exists()  # made (0700) by the process that records, not by every process vLLM starts
    assert config_from_env({"MEMTEL_TARGETS": "a.b:c", "MEMTEL_PORT": "off"}).port is None
    # The plugin reports unresolved targets when a vLLM worker has loaded the model, not on a timer.
    assert config.model_loaded == ("vllm.v1.worker.gpu_worker:Worker.load_model",)
    assert config.unresolved_after_s is None
    # Blank values leave the defaults.
    blank = config_from_env({"MEMTEL_TARGETS": "a.b:c", "MEMTEL_PORT": " ", "MEMTEL_LOG_DIR": "", "MEMTEL_ENABLE": ""})
    assert (blank.port, blank.log_dir) == (9200, None)


@pytest.mark.parametrize("env, message", [
    ({"MEMTEL_TARGETS": "a.b"}, "MEMTEL_TARGETS: unknown hook target or preset 'a.b'"),
    ({"MEMTEL_TARGETS": "a.b:c:d"}, "MEMTEL_TARGETS: malformed hook target 'a.b:c:d'"),
    ({"MEMTEL_TARGETS": "a.b:c", "MEMTEL_PORT": "92OO"}, "MEMTEL_PORT='92OO' is not a port"),
    ({"MEMTEL_TARGETS": "a.b:c", "MEMTEL_PORT": "70000"}, "MEMTEL_PORT='70000' is not a port"),
    ({"MEMTEL_TARGETS": "a.b:c", "MEMTEL_ENABLE": "maybe"}, "MEMTEL_ENABLE='maybe' is not a boolean"),
    ({"MEMTEL_ENABLE": "1"}, "MEMTEL_ENABLE is on but MEMTEL_TARGETS is empty"),
    ({"MEMTEL_TARGETS": "a.b:c", "MEMTEL_PORT": "0"}, "MEMTEL_PORT='0' is not a port"),
    ({"MEMTEL_TARGETS": "a.b:c", "MEMTEL_PORT": "+9200"}, "MEMTEL_PORT='+9200' is not a port"),
])
def test_bad_values_are_one_clear_log_line_and_telemetry_off(env, message, caplog):
    with pytest.raises(ValueError, match=re.escape(message)):
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


# issue 16, case 11: MEMTEL_PORT accepted digits of other scripts ("９２００" read as 9200 by int()).
@pytest.mark.parametrize("text", ["９２００", "٩٢٠٠", "9２00", "۹۲۰۰", "92\u200b00"])
def test_memtel_port_in_non_ascii_digits_is_refused(text, caplog):
    env = {"MEMTEL_TARGETS": "a.b:c", "MEMTEL_PORT": text}
    with pytest.raises(ValueError, match="written in ASCII digits"):
        config_from_env(env)
    register(env)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("memtel")]
    assert len(lines) == 1 and lines[0].startswith("memtel telemetry off: MEMTEL_PORT=")
    assert active_handle() is None


def test_memtel_port_in_ascii_digits_with_spaces_is_a_port():
    assert config_from_env({"MEMTEL_TARGETS": "a.b:c", "MEMTEL_PORT": " 9300\n"}).port == 9300


def test_every_memtel_variable_is_a_field_of_the_one_config():
    from telemetry.exporter import WEB_CONFIG_ENV
    from telemetry.hook.config import ENV_VARIABLES

    assert ENV_VARIABLES == ("MEMTEL_ENABLE", "MEMTEL_TARGETS", "MEMTEL_PORT", "MEMTEL_ADDR", "MEMTEL_WEB_CONFIG",
                             "MEMTEL_LOG_DIR", "MEMTEL_RECORD_SHAPE", "MEMTEL_FORECAST_TOKENS",
                             "MEMTEL_FORECAST_INTERVAL_S", "MEMTEL_FORECAST_SHAPE")
    assert WEB_CONFIG_ENV in ENV_VARIABLES
    documented = (ROOT / "docs" / "hook.md").read_text()
    assert all(f"`{name}`" in documented for name in ENV_VARIABLES)


def test_memtel_lines_appear_in_vllms_log_handler(tmp_path):
    # vLLM configures only its `vllm` logger (propagate off) and leaves the root bare: without routing,
    # the hook's INFO announcement went nowhere. A stand-in for vLLM's logging set-up, then the plugin.
    code = (
        "import logging, sys\n"
        "handler = logging.StreamHandler(sys.stdout)\n"
        "handler.setFormatter(logging.Formatter('VLLM-FORMAT %(levelname)s %(message)s'))\n"
        "vllm = logging.getLogger('vllm'); vllm.addHandler(handler); vllm.setLevel(logging.INFO)\n"
        "vllm.propagate = False\n"
        "from telemetry.vllm_plugin import register\n"
        "register()\n"
        "import json\n"
        "json.dumps([1])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MEMTEL_TARGETS": "json:dumps", "MEMTEL_PORT": "off"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if "memtel hook on" in line]
    assert len(lines) == 1 and lines[0].startswith("VLLM-FORMAT INFO memtel hook on in pid ")
    assert "hooked: json:dumps" in lines[0] and "exporter: off" in lines[0]
