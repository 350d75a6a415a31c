"""The hook's exporter: started only where something records, on MEMTEL_PORT + local rank, never fatal."""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry

import telemetry
from tests.support.ports import free_port, free_port_block

ROOT = Path(__file__).resolve().parents[2]


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_exporter_starts_only_at_the_first_hooked_call_on_port_plus_local_rank(tmp_path):
    base = free_port_block(3)
    (tmp_path / "rank_mod.py").write_text("def f(x):\n    return x\n")
    code = (f"import sys, time; sys.path.insert(0, {str(tmp_path)!r})\nimport telemetry\n"
            f"telemetry.install(['rank_mod:f'], port={base}, addr='127.0.0.1')\n"
            "print('installed', flush=True); sys.stdin.readline()\n"
            "import rank_mod; rank_mod.f(1); rank_mod.f(2)\n"
            "print('called', flush=True); sys.stdin.readline()\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOCAL_RANK": "2", "RANK": "6"}
    with subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True, env=env) as child:
        assert child.stdin is not None and child.stdout is not None
        try:
            assert child.stdout.readline().strip() == "installed"
            assert not any(_listening(base + i) for i in range(3))  # installed, nothing called: no exporter
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "called"
            assert not _listening(base) and not _listening(base + 1)
            text = httpx.get(f"http://127.0.0.1:{base + 2}/metrics", timeout=5).text
            line = next(x for x in text.splitlines() if x.startswith("memtel_hook_calls_total{"))
            assert 'site="rank_mod:f"' in line and 'rank="6"' in line and line.endswith(" 2.0")
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.wait(timeout=30) == 0
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()


def test_a_taken_exporter_port_is_counted_and_the_log_still_works(make_module, tmp_path, caplog):
    name = make_module("def f(x):\n    return x\n")
    module = importlib.import_module(name)
    port = free_port()
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", port))
        blocker.listen()
        registry = CollectorRegistry()
        handle = telemetry.install([f"{name}:f"], port=port, addr="127.0.0.1", log_dir=tmp_path, registry=registry)
        assert module.f(4) == 4 and module.f(5) == 5
        handle.flush()
        assert len(Path(handle.log_path).read_text().splitlines()) == 2
        assert registry.get_sample_value("memtel_hook_errors_total", {"site": "", "stage": "exporter", "rank": "0",
                                                                      "node": socket.gethostname()}) == 1
        assert handle.exporter_port is None
    warnings = [r.getMessage() for r in caplog.records if "exporter not started" in r.getMessage()]
    assert len(warnings) == 1 and f"port {port}" in warnings[0]
