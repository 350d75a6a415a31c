"""`memtel ab run` on bad ladder files: exit 2, the file and field named, and no server started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def ladder_with_marker_server(tmp_path: Path) -> tuple[dict, Path]:
    """A ladder whose served arm would leave a marker file if the harness ever started it."""
    marker = tmp_path / "server-started"
    port = free_port()
    return {
        "model": "tiny",
        "arms": [{"name": "a", "serve": {
            "command": [sys.executable, "-c", f"open({str(marker)!r}, 'w').write('started')"],
            "health_url": f"http://127.0.0.1:{port}/health", "startup_timeout_s": 5}}],
        "nodes": {"local": f"http://127.0.0.1:{free_port()}/metrics"},
        "steps": [{"label": "s", "tokens": 1000, "seed": 1}],
    }, marker


def run_ab(tmp_path: Path, data: dict, *extra: str) -> subprocess.CompletedProcess:
    path = tmp_path / "ladder.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return subprocess.run([sys.executable, "-m", "telemetry", "ab", "run", str(path), "--out", str(tmp_path / "run"),
                           *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_unknown_key_fails_before_any_server_starts(tmp_path):
    data, marker = ladder_with_marker_server(tmp_path)
    data["arms"][0]["serve"]["enviroment"] = {"X": "1"}
    result = run_ab(tmp_path, data)
    assert result.returncode == 2
    assert f"{tmp_path / 'ladder.yaml'}: arms[0].serve.enviroment: unknown key 'enviroment'" in result.stderr
    assert "valid keys here: command, health_url, env" in result.stderr
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_missing_field_fails_before_any_server_starts(tmp_path):
    data, marker = ladder_with_marker_server(tmp_path)
    del data["steps"][0]["seed"]
    result = run_ab(tmp_path, data)
    assert result.returncode == 2
    assert "steps[0].seed: missing (required)" in result.stderr
    assert not marker.exists()


def test_unreachable_node_fails_before_any_server_starts(tmp_path):
    data, marker = ladder_with_marker_server(tmp_path)
    result = run_ab(tmp_path, data)
    assert result.returncode == 2
    assert f"nodes.local: {data['nodes']['local']} is not reachable" in result.stderr
    assert not marker.exists() and not (tmp_path / "run" / "results.jsonl").exists()


def test_report_of_a_directory_without_results_is_a_clear_error(tmp_path):
    result = subprocess.run([sys.executable, "-m", "telemetry", "ab", "report", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "results.jsonl does not exist: not a run directory of `memtel ab run`" in result.stderr


def test_resume_and_overwrite_exclude_each_other(tmp_path):
    data, _marker = ladder_with_marker_server(tmp_path)
    result = run_ab(tmp_path, data, "--resume", "--overwrite")
    assert result.returncode == 2 and "exclude each other" in result.stderr


def test_overwrite_keeps_the_old_run_when_the_new_ladder_cannot_start(tmp_path):
    data, marker = ladder_with_marker_server(tmp_path)
    old = tmp_path / "run" / "results.jsonl"
    old.parent.mkdir()
    old.write_text('{"event": "run_start", "ts": 1.0}\n')
    refused = run_ab(tmp_path, data)
    assert refused.returncode == 2 and "already holds a run" in refused.stderr
    unreachable = run_ab(tmp_path, data, "--overwrite")  # the node URL does not answer
    assert unreachable.returncode == 2 and "is not reachable" in unreachable.stderr
    assert old.read_text() == '{"event": "run_start", "ts": 1.0}\n' and not marker.exists()
