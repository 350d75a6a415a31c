"""The rules ship with the package (issue 29): `memtel alerts` reads them as package data of telemetry.alerts, and
dashboards/prometheus/memtel-*.yml, the files Prometheus loads, are links to the same files (one source)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from telemetry.alerts.cli import RULE_FILES, default_rules
from telemetry.alerts.score import as_text, score
from telemetry.alerts.timeline import Outcome, Record, Timeline, load_timeline

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30


@pytest.mark.parametrize("name", RULE_FILES)
def test_prometheus_loads_the_package_rules(name):
    dashboards = ROOT / "dashboards" / "prometheus" / name
    package = resources.files("telemetry.alerts") / "rules" / name
    assert dashboards.is_symlink(), f"{dashboards} must link to telemetry/alerts/rules/{name} (one source)"
    assert dashboards.resolve() == (ROOT / "telemetry" / "alerts" / "rules" / name).resolve()
    assert dashboards.read_bytes() == package.read_bytes()


def quiet_timeline(seconds: int = 12) -> Timeline:
    values = {"memtel_node_mem_total_bytes": 24.0 * GIB, "memtel_node_mem_available_bytes": 20.0 * GIB,
              "memtel_node_unified_headroom_bytes": 20.0 * GIB}
    records = tuple(Record(1e9 + s, dict(values)) for s in range(seconds))
    return Timeline("quiet", Outcome("benign", node="box"), records)


@pytest.mark.prometheus
def test_a_core_install_without_the_repository_scores_with_the_shipped_rules(tmp_path):
    """The telemetry package alone (what a wheel installs: no dashboards/ beside it), run from a directory outside
    the repository: the rules come from the package through importlib.resources."""
    site = tmp_path / "site"
    shutil.copytree(ROOT / "telemetry", site / "telemetry", ignore=shutil.ignore_patterns("__pycache__"))
    timeline = tmp_path / "quiet.jsonl"
    lines = [{"memtel_timeline": {"outcome": "benign", "node": "box"}}]
    lines += [{"time": r.time, "values": r.values} for r in quiet_timeline().records]
    timeline.write_text("".join(json.dumps(line) + "\n" for line in lines))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    result = subprocess.run([sys.executable, "-B", "-m", "telemetry", "alerts", "score",
                             str(timeline)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    rules_line = result.stdout.splitlines()[0]
    assert rules_line == "rules: " + ", ".join(str(site / "telemetry" / "alerts" / "rules" / n) for n in RULE_FILES)
    assert "none fired" in result.stdout


@pytest.mark.prometheus
def test_a_quiet_timeline_prints_what_was_watched_not_an_empty_table():
    text = as_text(score([quiet_timeline()], default_rules()))
    assert "alert | severity" not in text
    assert re.search(r"^watched \d\d alerts over 11 s of timeline: none fired$", text, re.M), text
    assert "problems: none" in text


@pytest.mark.prometheus
def test_the_table_shows_the_alerts_that_fired_or_claim_a_failure():
    collapse = load_timeline(ROOT / "tests/fixtures/alerts/corpus/collapse-29-to-2.5-gib-in-9s.jsonl.gz")
    result = score([collapse], default_rules())
    rows = [line.split(" | ")[0] for line in as_text(result).splitlines() if line.startswith("Memtel")]
    fired = {name for name, s in result.alerts.items() if s.caught or s.benign_fired}
    assert set(rows) == fired | {"MemtelUnifiedHeadroomFalling"} and len(rows) < len(result.alerts) - 5, rows
    assert f"({len(result.alerts) - len(rows)} other alerts neither fired" in as_text(result)
