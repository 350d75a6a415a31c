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
        assert re.fullmatch(r"label_values\(.+,\s*%s\)" % name, variable["definition"]), variable["definition"]


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


def test_node_filter_on_every_query(dashboard):
    """Picking a node narrows every panel: each selector filters on node."""
    for panel in _content_panels(dashboard):
        for target in panel["targets"]:
            for selector in promql.selectors(target["expr"]):
                assert 'node=~"$node"' in selector, f"panel {panel['title']!r}: {selector} ignores $node"


def test_recording_rules_used_by_dashboards_exist():
    recorded = {r["record"] for r in promql.load_rules() if "record" in r}
    for path in promql.DASHBOARDS:
        for query in promql.dashboard_queries(path):
            for selector in promql.selectors(query.expr):
                name = promql.metric_name(selector)
                if ":" in name:
                    assert name in recorded, f"{query.where}: {name} is not a recording rule"


def _documented_metrics() -> set[str]:
    text = "".join((promql.ROOT / "docs" / name).read_text()
                   for name in ("metrics.md", "architecture.md", "hook.md") if (promql.ROOT / "docs" / name).exists())
    return set(re.findall(r"`(memtel_\w+)", text))


def test_every_metric_is_documented():
    """A misspelt name fails here already, without a live Prometheus."""
    documented = _documented_metrics()
    queries = [q for p in promql.DASHBOARDS for q in promql.dashboard_queries(p)] + promql.rule_queries()
    for query in queries:
        for selector in promql.selectors(query.expr):
            name = promql.metric_name(selector)
            histogram = re.sub(r"_(bucket|sum|count)$", "", name)  # series of a documented histogram
            if name.startswith("memtel_"):
                assert name in documented or histogram in documented, f"{query.where}: {name} is in no docs/*.md"


def test_provisioning_files():
    root = promql.ROOT / "configs" / "grafana" / "provisioning"
    datasources = yaml.safe_load((root / "datasources" / "memtel-prometheus.yml").read_text())
    assert datasources["apiVersion"] == 1
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"].startswith("http")
    providers = yaml.safe_load((root / "dashboards" / "memtel-dashboards.yml").read_text())
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
