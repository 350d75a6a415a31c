"""The Prometheus rules and config with promtool (Debian's prometheus package), plus their conventions."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.dashboards import promql

pytestmark = pytest.mark.prometheus

RULES_DIR = promql.ROOT / "dashboards" / "prometheus"
UNIT_TESTS = sorted((RULES_DIR / "tests").glob("*.yml"))
CONFIG = promql.ROOT / "configs" / "prometheus" / "prometheus.yml"
RUNBOOK = promql.ROOT / "docs" / "runbook.md"
ALERTS = [r for r in promql.load_rules() if "alert" in r]


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is missing: install Debian's prometheus package (scripts/test does it: "
                    "`source scripts/lib/setup.sh && ensure_system_packages`, as root)")
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"{' '.join(result.args)}:\n{result.stdout}\n{result.stderr}"


def test_promtool_check_rules():
    assert_ok(promtool("check", "rules", *map(str, promql.RULE_FILES)))


def test_promtool_test_rules():
    assert UNIT_TESTS, "no unit tests in dashboards/prometheus/tests"
    assert_ok(promtool("test", "rules", *map(str, UNIT_TESTS)))


def test_promtool_check_config_with_rule_and_target_files():
    # promtool also loads the rule files and every file_sd targets file the globs match.
    result = promtool("check", "config", str(CONFIG))
    assert_ok(result)
    assert "2 rule files found" in result.stdout + result.stderr


def test_example_targets_files_are_matched_by_the_fleet_jobs():
    config = yaml.safe_load(CONFIG.read_text())
    globs = [f for job in config["scrape_configs"] for sd in job.get("file_sd_configs", []) for f in sd["files"]]
    matched = {p for pattern in globs for p in CONFIG.parent.glob(pattern)}
    assert matched == set((CONFIG.parent / "targets").glob("*.yml")), (globs, matched)


def test_every_alert_follows_the_conventions():
    anchors = _runbook_anchors()
    for rule in ALERTS:
        name = rule["alert"]
        assert "for" in rule, f"{name}: no `for`"
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        annotations = rule["annotations"]
        assert annotations["summary"] and annotations["description"], name
        url = annotations["runbook_url"]
        assert re.fullmatch(r"docs/runbook\.md#[a-z0-9-]+", url), f"{name}: runbook_url {url}"
        assert url.split("#")[1] == name.lower(), f"{name}: runbook anchor should be #{name.lower()}"
        assert url.split("#")[1] in anchors, f"{name}: docs/runbook.md has no section #{url.split('#')[1]}"


def test_runbook_has_no_section_without_an_alert():
    names = {r["alert"].lower() for r in ALERTS}
    sections = {a for a in _runbook_anchors(level=2)}
    assert sections == names, f"runbook sections without alert: {sections - names}; alerts without: {names - sections}"


def test_every_alert_has_unit_tests_that_fire_and_stay_quiet():
    fires, quiet = set(), set()
    for path in UNIT_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {r["alert"] for r in ALERTS}
    assert names - fires == set(), f"alerts never shown to fire: {sorted(names - fires)}"
    assert names - quiet == set(), f"alerts never shown to stay quiet: {sorted(names - quiet)}"


@pytest.mark.parametrize("alert, naive_expr", [
    # Would page on every line replayed from the ring buffer and on every restart.
    ("MemtelNvErrNoMemory", "memtel_kernel_nv_err_no_memory_total > 0"),
    # Would page on a counter reset after a daemon restart.
    ("MemtelNvErrNoMemory", "changes(memtel_kernel_nv_err_no_memory_total[15m]) > 0"),
    # Would miss the first Xid of a code: its series appears with the value 1.
    ("MemtelGpuXidCritical", 'increase(memtel_kernel_xid_total{xid=~"48|61|62|64|74|79|95|119|120"}[15m]) > 0'),
])
def test_unit_tests_reject_a_naive_rule(tmp_path, alert, naive_expr):
    """The unit tests have teeth: swapping in a plausible but wrong expression makes them fail."""
    (tmp_path / "tests").mkdir()
    groups = yaml.safe_load((RULES_DIR / "memtel-alerts.yml").read_text())
    for group in groups["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alert:
                rule["expr"] = naive_expr
    (tmp_path / "memtel-alerts.yml").write_text(yaml.safe_dump(groups, sort_keys=False))
    shutil.copy(RULES_DIR / "memtel-recording.yml", tmp_path)
    shutil.copy(RULES_DIR / "tests" / "kernel_log_test.yml", tmp_path / "tests")
    result = promtool("test", "rules", "tests/kernel_log_test.yml", cwd=tmp_path)
    assert result.returncode != 0, f"the unit tests accepted {alert} = {naive_expr!r}"
    assert alert in result.stdout + result.stderr


def _runbook_anchors(level: int | None = None) -> set[str]:
    """GitHub-style anchors of the runbook's headings (of one level, if given)."""
    anchors = set()
    for line in RUNBOOK.read_text().splitlines():
        match = re.match(r"#{%s}\s+(.*)" % (level if level else "1,6"), line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            anchors.add(slug)
    return anchors
