"""The Prometheus rules and config with promtool, the Alertmanager config with amtool (Debian's packages),
and the conventions of both."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.dashboards import promql
from tests.dashboards.promtool_runs import FileOutcome, run_unit_tests

pytestmark = pytest.mark.prometheus

RULES_DIR = promql.ROOT / "dashboards" / "prometheus"
UNIT_TESTS = sorted((RULES_DIR / "tests").glob("*.yml"))
CONFIG = promql.ROOT / "configs" / "prometheus" / "prometheus.yml"
TARGETS = CONFIG.parent / "targets"
ALERTMANAGER = promql.ROOT / "configs" / "alertmanager" / "alertmanager.yml"
RUNBOOK = promql.ROOT / "docs" / "runbook.md"
ALERTS = [r for r in promql.load_rules() if "alert" in r]
RUNBOOK_URL = re.compile(r"\{\{ \$externalLabels\.runbook_base \}\}#([a-z0-9-]+)")
# Families whose critical alert silences the warnings of the family in Alertmanager.
FAMILY = re.compile(r"[a-z][a-z0-9-]*")


def _tool(binary: str, package: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    path = shutil.which(binary)
    if path is None:
        pytest.fail(f"{binary} is missing: install Debian's {package} package (scripts/test does it: "
                    "`source scripts/lib/setup.sh && ensure_system_packages`, as root)")
    return subprocess.run([path, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return _tool("promtool", "prometheus", *args, cwd=cwd)


def amtool(*args: str) -> subprocess.CompletedProcess:
    return _tool("amtool", "prometheus-alertmanager", *args)


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"{' '.join(result.args)}:\n{result.stdout}\n{result.stderr}"


def test_promtool_check_rules():
    assert_ok(promtool("check", "rules", *map(str, promql.RULE_FILES)))


def test_promtool_test_rules():
    assert UNIT_TESTS, "no unit tests in dashboards/prometheus/tests"
    outcomes = run_unit_tests(UNIT_TESTS)
    failed = [o.output for o in outcomes.values() if not o.passed]
    assert not failed, "\n".join(failed)
    assert set(outcomes) == set(UNIT_TESTS)


def test_promtool_check_config_with_rule_files():
    result = promtool("check", "config", str(CONFIG))
    assert_ok(result)
    assert "2 rule files found" in result.stdout + result.stderr


def test_the_shipped_config_scrapes_nothing_until_targets_are_written():
    """Out of the box no example host is scraped: no targets file matches, only the *.example files ship."""
    config = yaml.safe_load(CONFIG.read_text())
    globs = [f for job in config["scrape_configs"] for sd in job.get("file_sd_configs", []) for f in sd["files"]]
    assert all(job.get("file_sd_configs") and not job.get("static_configs") for job in config["scrape_configs"])
    matched = sorted(str(p) for pattern in globs for p in CONFIG.parent.glob(pattern))
    assert not matched, f"the shipped config would scrape {matched}"
    examples = sorted(TARGETS.glob("*.yml.example"))
    assert [p.name for p in examples] == ["daemon.yml.example", "hook.yml.example", "vllm.yml.example"]
    for example in examples:  # each example becomes a real targets file by dropping .example
        assert any(Path(example.name.removesuffix(".example")).match(Path(g).name) for g in globs), example.name


def test_the_config_with_the_example_targets_files_is_valid(tmp_path):
    """Copied into place as the comments say, the examples make a valid config with explicit node labels."""
    shutil.copytree(CONFIG.parent, tmp_path / "prometheus")
    shutil.copytree(promql.ROOT / "dashboards", tmp_path / "dashboards")
    (tmp_path / "configs").mkdir()
    shutil.move(tmp_path / "prometheus", tmp_path / "configs" / "prometheus")
    targets = tmp_path / "configs" / "prometheus" / "targets"
    for example in targets.glob("*.yml.example"):
        shutil.copy(example, targets / example.name.removesuffix(".example"))
        for group in yaml.safe_load(example.read_text()):
            assert group["labels"]["node"], f"{example.name}: a target group without an explicit node label"
    result = promtool("check", "config", str(tmp_path / "configs" / "prometheus" / "prometheus.yml"))
    assert_ok(result)
    assert "WARNING" not in result.stdout + result.stderr, result.stdout + result.stderr


def test_the_hook_examples_list_one_exporter_per_spark():
    groups = yaml.safe_load((TARGETS / "hook.yml.example").read_text())
    for group in groups:
        assert len(group["targets"]) == 1, f"a DGX Spark has one GPU, one rank, one exporter: {group}"
    assert "9201" in (TARGETS / "hook.yml.example").read_text(), "the commented multi-GPU example is gone"


def test_every_file_the_config_comments_name_exists():
    """The comments of the shipped configs point at files that are there."""
    for config in (CONFIG, ALERTMANAGER, *TARGETS.glob("*.example")):
        for line in config.read_text().splitlines():
            if not line.lstrip().startswith("#"):
                continue
            for name in re.findall(r"[\w./*-]+\.(?:yml|yaml|md|json)(?:\.example)?\b", line):
                if name.startswith(("/", "http")) or "example.internal" in name:
                    continue
                candidates = [promql.ROOT / name, config.parent / name, CONFIG.parent / name]
                # A targets file the SRE writes (targets/daemon.yml, targets/daemon*.yml) exists as an example.
                found = [c for c in candidates
                         if list(c.parent.glob(c.name)) or (c.parent.name == "targets" and
                                                            list(c.parent.glob(c.name + ".example")))]
                assert found, f"{config.name}: the comment names {name}, which does not exist: {line}"


def _relabel(rules: list[dict], labels: dict[str, str]) -> dict[str, str]:
    """Prometheus' `replace` relabelling, in order (regexes anchored at both ends, $1 groups)."""
    labels = dict(labels)
    for rule in rules:
        value = rule.get("separator", ";").join(labels.get(name, "") for name in rule["source_labels"])
        match = re.fullmatch(rule["regex"], value)
        if match:
            labels[rule["target_label"]] = match.expand(re.sub(r"\$(\d+)", r"\\g<\1>", rule["replacement"]))
    return labels


@pytest.mark.parametrize("labels, node", [
    ({"__address__": "192.168.100.11:9101"}, "192.168.100.11"),   # was "192": a pair merged into one node
    ({"__address__": "10.0.0.5:9200"}, "10.0.0.5"),
    ({"__address__": "[fe80::1]:9101"}, "fe80::1"),
    ({"__address__": "spark-a.example.internal:9101"}, "spark-a"),
    ({"__address__": "spark-b:9101"}, "spark-b"),
    ({"__address__": "192.168.100.11:9101", "node": "spark-a"}, "spark-a"),  # the targets file wins
])
def test_node_label_from_the_targets_file_or_the_whole_host(labels, node):
    config = yaml.safe_load(CONFIG.read_text())
    for job in config["scrape_configs"]:
        assert job["relabel_configs"], f"{job['job_name']}: no node relabelling"
        assert _relabel(job["relabel_configs"], labels)["node"] == node, job["job_name"]


def test_the_targets_file_node_wins_over_the_hooks_own():
    config = yaml.safe_load(CONFIG.read_text())
    hook = next(job for job in config["scrape_configs"] if job["job_name"] == "memtel-hook")
    assert not hook.get("honor_labels"), "the hook's own node label (its host name) would win over the targets file"
    assert {"action": "labeldrop", "regex": "exported_node"} in hook["metric_relabel_configs"]


def test_runbook_base_is_set_once_and_absolute():
    config = yaml.safe_load(CONFIG.read_text())
    base = config["global"]["external_labels"]["runbook_base"]
    assert re.fullmatch(r"https?://[^\s#]+", base), base


def test_amtool_check_config():
    result = amtool("check-config", str(ALERTMANAGER))
    assert_ok(result)
    assert "2 inhibit rules" in result.stdout


def test_the_commented_receiver_examples_are_valid(tmp_path):
    """The pager and chat examples in alertmanager.yml's comments, uncommented, pass amtool."""
    text = ALERTMANAGER.read_text()
    head, _, examples = text.partition("  # Examples")
    lines = [line.replace("  # ", "  ", 1) for line in examples.splitlines()[1:] if line.startswith("  # ")]
    uncommented = head + "\n".join(lines).replace("/etc/alertmanager/", f"{tmp_path}/") + "\n"
    (tmp_path / "pagerduty.key").write_text("0123456789abcdef\n")
    (tmp_path / "slack.url").write_text("https://hooks.slack.example/services/x\n")
    (tmp_path / "alertmanager.yml").write_text(uncommented)
    result = amtool("check-config", str(tmp_path / "alertmanager.yml"))
    assert_ok(result)
    assert "3 receivers" in result.stdout, result.stdout


def test_alertmanager_groups_by_node_and_inhibits_by_node_and_family():
    config = yaml.safe_load(ALERTMANAGER.read_text())
    assert "node" in config["route"]["group_by"]
    rules = config["inhibit_rules"]
    node_down = next(r for r in rules if 'alertname="MemtelNodeDown"' in r["source_matchers"])
    assert node_down["equal"] == ["node"]
    family = next(r for r in rules if 'severity="critical"' in r["source_matchers"])
    assert family["equal"] == ["node", "family"]
    assert 'family=~".+"' in family["source_matchers"] and 'family=~".+"' in family["target_matchers"]
    families: dict[str, set[str]] = {}
    for rule in ALERTS:
        families.setdefault(rule["labels"]["family"], set()).add(rule["labels"]["severity"])
    assert any(s == {"critical", "warning"} for s in families.values()), families


def test_every_alert_follows_the_conventions():
    anchors = _runbook_anchors()
    for rule in ALERTS:
        name = rule["alert"]
        assert "for" in rule, f"{name}: no `for`"
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        annotations = rule["annotations"]
        assert annotations["summary"] and annotations["description"], name
        assert FAMILY.fullmatch(rule["labels"]["family"]), f"{name}: family {rule['labels'].get('family')}"
        url = RUNBOOK_URL.fullmatch(annotations["runbook_url"])
        assert url, f"{name}: runbook_url {annotations['runbook_url']} is not the runbook base plus an anchor"
        assert url.group(1) == name.lower(), f"{name}: runbook anchor should be #{name.lower()}"
        assert url.group(1) in anchors, f"{name}: docs/runbook.md has no section #{url.group(1)}"


def test_runbook_has_no_section_without_an_alert():
    names = {r["alert"].lower() for r in ALERTS}
    sections = {a for a in _runbook_anchors(level=2)}
    assert sections == names, f"runbook sections without alert: {sections - names}; alerts without: {names - sections}"


def test_every_alert_has_unit_tests_that_fire_and_stay_quiet():
    fires: set[str] = set()
    quiet: set[str] = set()
    for path in UNIT_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {r["alert"] for r in ALERTS}
    assert names - fires == set(), f"alerts never shown to fire: {sorted(names - fires)}"
    assert names - quiet == set(), f"alerts never shown to stay quiet: {sorted(names - quiet)}"


# (alert, a plausible but wrong expression for it, the unit-test file that must catch it)
NAIVE_RULES = [
    # Would page on every line replayed from the ring buffer and on every restart.
    ("MemtelNvErrNoMemory", "memtel_kernel_nv_err_no_memory_total > 0", "kernel_log_test.yml"),
    # Would page on a counter reset after a daemon restart.
    ("MemtelNvErrNoMemory", "changes(memtel_kernel_nv_err_no_memory_total[15m]) > 0", "kernel_log_test.yml"),
    # Would miss the first Xid of a code: its series appears with the value 1.
    ("MemtelGpuXidCritical", 'increase(memtel_kernel_xid_total{xid=~"48|61|62|64|74|79|95|119|120"}[15m]) > 0',
     "kernel_log_test.yml"),
    # A 30 s fit is too slow for the 9-second collapse; a 2-sample fit fires on noise at rest.
    ("MemtelUnifiedHeadroomFalling", "predict_linear(memtel_node_unified_headroom_bytes[30s], 30) < 0",
     "headroom_test.yml"),
    ("MemtelUnifiedHeadroomFalling", "predict_linear(memtel_node_unified_headroom_bytes[8s], 30) < 0",
     "headroom_test.yml"),
    # MemAvailable stays at 60 GiB through the collapse.
    ("MemtelUnifiedHeadroomLow", "memtel_node_mem_available_bytes < 4 * 1024 * 1024 * 1024", "headroom_test.yml"),
    # Fragmentation is not "little contiguous memory" alone: with MemAvailable low too, the headroom alert speaks.
    ("MemtelContiguousMemoryExhausted", "memtel_node_mem_free_contiguous_bytes < 4 * 1024 * 1024 * 1024",
     "headroom_test.yml"),
    # Summing a rank's per-site copies of its forecast counts it twice.
    ("MemtelPrefillWouldNotFit", "sum by (node, tokens) (memtel_forecast_reserved_growth_bytes) > on (node) "
     "group_left () node:memtel_node_unified_headroom_bytes:min", "headroom_test.yml"),
    # One alert per hooked site instead of per rank; and an old count paging a new Prometheus.
    ("MemtelAllocatorOom", "increase(memtel_allocator_ooms_total[15m]) > 0", "allocator_test.yml"),
    ("MemtelAllocatorOom", "max by (node, rank) (increase(memtel_allocator_ooms_total[15m]) > 0 or "
     "(memtel_allocator_ooms_total > 0 unless memtel_allocator_ooms_total offset 15m))", "allocator_test.yml"),
    # Swap in pages: 16x apart between 4 KiB and 64 KiB page kernels.
    ("MemtelSwapping", "rate(memtel_node_vmstat_pswpin_total[5m]) + rate(memtel_node_vmstat_pswpout_total[5m]) "
     "> 100", "host_memory_test.yml"),
    # Issue 29: the three conditions alone page on an engine's start that its hook announced.
    ("MemtelUnifiedHeadroomFalling",
     next(r["expr"] for r in ALERTS if r["alert"] == "MemtelUnifiedHeadroomFalling").split("unless on (node)")[0],
     "headroom_test.yml"),
    # Issue 38: NV_ERR_NO_MEMORY alone pages on a normal start; a process that goes alone pages on a restart.
    ("MemtelEngineDiedOfMemory", "max by (node) (increase(memtel_kernel_nv_err_no_memory_total[1m])) > 0",
     "engine_death_test.yml"),
    ("MemtelEngineDiedOfMemory", "max by (node) (max_over_time(memtel_process_role_processes[30s]) "
     "- memtel_process_role_processes) > 0", "engine_death_test.yml"),
    # No token out is not a stall: a long prefill makes none for minutes while its steps and hooked calls run.
    ("MemtelEngineStalled", "max by (node) (vllm:num_requests_running) > 0 unless on (node) "
     "(sum by (node) (increase(vllm:generation_tokens_total[3m])) > 0)", "engine_test.yml"),
]


def _cases_of(alert: str, unit_tests: str) -> list[dict]:
    """The test groups of the file that can see `alert`: those that check it (alert_rule_test) or query it or
    ALERTS (promql_expr_test). Changing one alert's expression changes nothing any other group looks at."""
    cases = yaml.safe_load((RULES_DIR / "tests" / unit_tests).read_text())
    return [case for case in cases["tests"]
            if any(check["alertname"] == alert for check in case.get("alert_rule_test", []))
            or any(alert in check["expr"] or "ALERTS" in check["expr"] for check in case.get("promql_expr_test", []))]


def _naive_unit_test(directory: Path, alert: str, naive_expr: str, unit_tests: str) -> Path:
    """A copy of the rules with `alert`'s expression replaced, and of the unit-test file's groups that see it."""
    (directory / "tests").mkdir(parents=True)
    groups = yaml.safe_load((RULES_DIR / "memtel-alerts.yml").read_text())
    replaced = 0
    for group in groups["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alert:
                rule["expr"] = naive_expr
                replaced += 1
    assert replaced == 1, alert
    (directory / "memtel-alerts.yml").write_text(yaml.safe_dump(groups, sort_keys=False))
    shutil.copy(RULES_DIR / "memtel-recording.yml", directory)
    unit = yaml.safe_load((RULES_DIR / "tests" / unit_tests).read_text())
    unit["tests"] = _cases_of(alert, unit_tests)
    assert unit["tests"], f"{unit_tests} has no test group that checks {alert}"
    path = directory / "tests" / unit_tests
    path.write_text(yaml.safe_dump(unit, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def naive_outcomes(tmp_path_factory) -> dict[int, FileOutcome]:
    """Every naive rule's unit tests, all in one batch of promtool runs (case number -> its outcome)."""
    root = tmp_path_factory.mktemp("naive-rules")
    paths = [_naive_unit_test(root / str(n), *case) for n, case in enumerate(NAIVE_RULES)]
    outcomes = run_unit_tests(paths)
    return {n: outcomes[path] for n, path in enumerate(paths)}


@pytest.mark.parametrize("case", range(len(NAIVE_RULES)),
                         ids=[f"{alert}-{expr}-{file}" for alert, expr, file in NAIVE_RULES])
@pytest.mark.slow
def test_unit_tests_reject_a_naive_rule(naive_outcomes, case):
    """The unit tests have teeth: swapping in a plausible but wrong expression makes them fail."""
    alert, naive_expr, _ = NAIVE_RULES[case]
    outcome = naive_outcomes[case]
    assert not outcome.passed, f"the unit tests accepted {alert} = {naive_expr!r}:\n{outcome.output}"
    assert alert in outcome.output, outcome.output


def _runbook_anchors(level: int | None = None) -> set[str]:
    """GitHub-style anchors of the runbook's headings (of one level, if given)."""
    anchors = set()
    for line in RUNBOOK.read_text().splitlines():
        match = re.match(r"#{%s}\s+(.*)" % (level if level else "1,6"), line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            anchors.add(slug)
    return anchors
