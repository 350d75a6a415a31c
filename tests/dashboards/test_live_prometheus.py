"""A DGX Spark pair addressed by IP, live: every target up, node labels right, no alert at rest, every
dashboard and rule expression returning data, and the NV_ERR_NO_MEMORY alert reaching a webhook
through a real Alertmanager.

The stack is tests/dashboards/live.py's `TwoNodeStack`: node spark-a on 127.0.0.2 (its targets carry
`node: spark-a`), a second node on 127.0.0.3 whose targets carry no node label (so `node` must be its
whole address, "127.0.0.3", never "127"), each with a real daemon, one hook exporter and a vLLM-shaped
server, scraped by Prometheus with the shipped configuration and rules (every job scraped every second),
alerting a real Alertmanager with the shipped configuration (group_wait 1 s). It is the package's live stack
(tests/dashboards/conftest.py), whose Prometheus also scrapes the collapse source of
test_live_prometheus_collapse.py under its own node.

The module runs in two phases. At rest (the package's stack fixture, before anything happens): the targets
and every alert pending or firing at any rule evaluation of the settle time are recorded. Then events (the
`events` fixture): the hook processes start growing their allocators and failing now and then, one prefill
goes to each vLLM server, and Xid 79, Xid 13, an OOM kill and NV_ERR_NO_MEMORY lines go into spark-a's
kernel log (a file its daemon follows: nothing is written into the machine's kernel log).

What "every expression returns data" means, and how conditions are handled:
- Dashboard queries run twice: with every template variable set to `.*` (Grafana's "All") and with
  the first real value of each variable, as its own `label_values` query returns it (the node: each of
  the two nodes').
- Rule expressions (alerts and recording rules) run with every comparison turned into a `bool`
  comparison (promql.boolify): `x > 0` becomes `x > bool 0`, which returns x's series with 0 or 1.
  An empty result then means a misspelt metric or label, not a condition that is false right now.
- Every vector selector is also queried on its own, every label it matches on must exist on its
  series, and every label of a by/on/without/ignoring clause must exist on the expression's series.
- Series that cannot exist here are checked against the documentation instead, and listed in the
  output: GPU series (no NVIDIA driver: the daemons run without the nvml collector) and
  promql.PENDING_METRICS (exported by no part of memtel yet). The previous boot's flight-recorder
  series exist for spark-a: its daemon first runs under another boot id.
"""

from __future__ import annotations

import re
import time
from datetime import datetime

import pytest

from telemetry.procfs.headroom import read_thp_mode, thp_faults_compact
from tests.dashboards import promql
from tests.dashboards.collapse import NODE as COLLAPSE_NODE
from tests.dashboards.live import GROUP_WAIT_S, RUNBOOK_BASE, LiveNode, TwoNodeStack, wait_until

pytestmark = [pytest.mark.prometheus, pytest.mark.slow, pytest.mark.timeout(420)]

NV_ERR_LINE = ("NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) "
               "returned from _memdescAllocInternal(pMemDesc) @ mem_desc.c:1359")
EVENT_LINES = (
    "NVRM: Xid (PCI:000f:01:00): 79, pid=1, name=memtel-live-test, GPU has fallen off the bus.",
    "NVRM: Xid (PCI:000f:01:00): 13, pid=1, name=memtel-live-test, Graphics Exception: ESR 0x4041b0",
    "Out of memory: Killed process 999999 (memtel-live-test) total-vm:0kB, anon-rss:0kB, file-rss:0kB",
)
ALERT_TIMEOUT_S = 30
WEBHOOK_TIMEOUT_S = 45  # Alertmanager's group_wait (1 s in the test stack, 10 s shipped) after Prometheus sends it
SERIES_TIMEOUT_S = 100  # some queries compare with a minute ago (`offset 1m`)
# GPU series, and the recording rules computed from them (the ledger's GPU lines), exist only with an NVIDIA driver.
_GPU_SERIES = r"\bmemtel_gpu_\w+"
_GPU_RULES = [rule["record"] for rule in promql.load_rules()
              if "record" in rule and re.search(_GPU_SERIES, rule["expr"])]
GPU_ONLY = re.compile("|".join([_GPU_SERIES, *(re.escape(name) + r"(?![\w:])" for name in _GPU_RULES)]))
# Series this stack cannot have, with why; their queries are checked against the docs only, as the GPU's.
NOT_IN_THIS_STACK = {
    re.compile(r"\bmemtel_guard_\w+"): "the guard's series: no guard in this stack (tests/guard scrapes them live)",
    re.compile(r"\bmemtel_engine_start_remaining_bytes\b|\bnode_engine:|after_starts_bytes\b"):
        "an engine's start (issue 29): exported only while an engine starts (headroom_test.yml, "
        "tests/alerts/test_engine_start.py)",
}
# The events add huge-page faults to each node's vmstat; the daemon counts them as evidence (and exports the
# success ratio) only where this machine's THP mode makes faults compact (telemetry.procfs.headroom).
HUGE_PAGE_FAULTS = (60, 2)  # (got a huge page, fell back): a ratio of 0.97, MemtelContiguousMemoryExhausted quiet
_THP_MODE = read_thp_mode()
if _THP_MODE is None or not thp_faults_compact(*_THP_MODE):
    NOT_IN_THIS_STACK[re.compile(r"\bmemtel_node_huge_page_fault_success_ratio\b")] = (
        f"this machine's THP mode {_THP_MODE} makes huge-page faults no evidence: the daemon exports no ratio")
# Selectors of series remote-written by a Prometheus agent (its `agent` external label); the expression
# around them is still checked, and listed.
AGENT_ONLY = re.compile(r'agent!=""')
# Alerts that can fire at rest only because of the real machine: none, since the daemons read fixed
# memory files. Listed empty on purpose: anything active at rest is a configuration fault.
ALLOWED_AT_REST: frozenset[str] = frozenset()


@pytest.fixture(scope="module")
def stack(live_stack) -> TwoNodeStack:
    """The package's live stack (tests/dashboards/conftest.py), its two nodes; looked at at rest already."""
    return live_stack.nodes


def _targets_nodes(live_stack, job: str) -> dict[str, str]:
    """address -> node label of every target of `job`: the two nodes, and the collapse source as a daemon."""
    expected = {n.ip: n.node for n in live_stack.nodes.nodes}
    if job == "memtel-daemon":
        expected[live_stack.collapse.address.rsplit(":", 1)[0]] = COLLAPSE_NODE
    return expected


def spark_a(stack: TwoNodeStack) -> LiveNode:
    return stack.nodes[0]


@pytest.fixture(scope="module")
def events(stack):
    """Leave rest: growing hooks, one prefill per node, kernel lines on spark-a. Unix time of the NV_ERR line."""
    stack.start_growing()
    for node in stack.nodes:
        stack.add_huge_page_faults(node, *HUGE_PAGE_FAULTS)
    for node in stack.nodes:
        assert stack.prefill(node, 3000)["usage"]["prompt_tokens"] == 3000
    log = stack.kernel_logs[spark_a(stack).ip]
    for line in EVENT_LINES:
        log.write(line)
    written_at = time.time()
    log.write(NV_ERR_LINE)
    return written_at


def test_every_target_is_up_and_labelled_by_its_node(stack, live_stack):
    by_job: dict[str, dict[str, str]] = {}
    for target in stack.rest_targets:
        labels = target["labels"]
        assert target["health"] == "up", f"{target['scrapeUrl']}: {target.get('lastError')}"
        ip = labels["instance"].rsplit(":", 1)[0]
        by_job.setdefault(labels["job"], {})[ip] = labels["node"]
    jobs = ("memtel-daemon", "memtel-hook", "memtel-vllm")
    assert by_job == {job: _targets_nodes(live_stack, job) for job in jobs}, by_job
    assert {n.ip: n.node for n in stack.nodes} == {"127.0.0.2": "spark-a", "127.0.0.3": "127.0.0.3"}


def test_every_series_carries_its_targets_node(stack, live_stack):
    """The hook reports its host name itself; the targets file's node must win, on every series."""
    for job in ("memtel-daemon", "memtel-hook", "memtel-vllm"):
        rows = stack.prometheus.query(f'count by (node, instance) ({{job="{job}"}})')
        seen = {r["metric"]["instance"].rsplit(":", 1)[0]: r["metric"].get("node") for r in rows}
        assert seen == _targets_nodes(live_stack, job), f"{job}: {seen}"
    assert not stack.prometheus.query('count({job="memtel-hook", exported_node!=""})'), "exported_node kept"


def test_no_alert_at_rest(stack):
    active = {(a["labels"]["alertname"], a["labels"].get("node"), a["state"]) for a in stack.rest_alerts}
    unexpected = {a for a in active if a[0] not in ALLOWED_AT_REST}
    assert not unexpected, f"alerts pending or firing at rest: {sorted(unexpected, key=str)}"
    assert not stack.rest_webhook, f"Alertmanager notified at rest: {stack.rest_webhook}"
    # The rules were evaluated all along: an empty list is not a Prometheus without rules.
    groups = {g["name"]: g for g in stack.prometheus.rule_groups()}
    assert {"memtel-headroom", "memtel-kernel-log", "memtel-telemetry-health"} <= set(groups)
    assert all(g["lastEvaluation"] > "2000" for g in groups.values()), "a rule group never evaluated"


def test_nv_err_line_raises_the_alert_on_its_node_only(stack, events):
    started = time.monotonic()
    alerts = wait_until("MemtelNvErrNoMemory firing after the NV_ERR_NO_MEMORY line",
                        lambda: stack.prometheus.alerts("MemtelNvErrNoMemory", states=("firing",)),
                        timeout=ALERT_TIMEOUT_S)
    print(f"MemtelNvErrNoMemory firing {time.monotonic() - started:.1f} s after the line")
    assert [a["labels"]["node"] for a in alerts] == ["spark-a"]
    alert = alerts[0]
    assert alert["labels"]["severity"] == "warning"
    assert alert["annotations"]["runbook_url"] == f"{RUNBOOK_BASE}#memtelnverrnomemory"
    assert _parse_time(alert["activeAt"]) >= events - 2.0, f"active since {alert['activeAt']}, before the line"


def test_nv_err_alert_reaches_the_webhook_through_alertmanager(stack, events):
    started = time.monotonic()
    received = wait_until("MemtelNvErrNoMemory posted to the webhook by Alertmanager",
                          lambda: stack.webhook.alerts("MemtelNvErrNoMemory", status="firing"),
                          timeout=WEBHOOK_TIMEOUT_S)
    print(f"MemtelNvErrNoMemory at the webhook {time.monotonic() - started:.1f} s after the line")
    alert = received[0]
    assert alert["labels"]["node"] == "spark-a" and alert["labels"]["severity"] == "warning"
    assert alert["labels"]["family"] == "host-memory"
    url = alert["annotations"]["runbook_url"]
    assert url == f"{RUNBOOK_BASE}#memtelnverrnomemory" and url.startswith("https://"), url
    assert alert["receiver"] == "memtel-webhook"
    # Grouped by node and alert name: the notification holds this node's NV_ERR alert only.
    body = next(b for b in stack.webhook.notifications() if any(a is not None and a["labels"].get("alertname") ==
                                                               "MemtelNvErrNoMemory" for a in b["alerts"]))
    assert body["groupLabels"] == {"node": "spark-a", "alertname": "MemtelNvErrNoMemory"}, body["groupLabels"]


def test_critical_xid_silences_the_xid_warning_of_its_node(stack, events):
    """Inhibition by family: Xid 79 (critical) pages; Xid 13 (warning, same family, same node) does not."""
    wait_until("MemtelGpuXidCritical at the webhook", lambda: stack.webhook.alerts("MemtelGpuXidCritical"),
               timeout=WEBHOOK_TIMEOUT_S)
    prometheus_says = stack.prometheus.alerts("MemtelGpuXid", states=("firing",))
    assert [a["labels"]["xid"] for a in prometheus_says] == ["13"], "Prometheus should fire the Xid 13 warning"
    suppressed = wait_until("Xid 13 warning suppressed in Alertmanager", lambda: [
        a for a in stack.client.get(f"{stack.alertmanager_url}/api/v2/alerts").json()
        if a["labels"]["alertname"] == "MemtelGpuXid" and a["status"]["state"] == "suppressed"], timeout=30)
    assert suppressed[0]["status"]["inhibitedBy"], suppressed[0]["status"]
    time.sleep(GROUP_WAIT_S + 2)  # past group_wait: had it not been inhibited, it would have been posted by now
    assert not stack.webhook.alerts("MemtelGpuXid"), "the inhibited Xid warning reached the webhook"


def _parse_time(text: str) -> float:
    """Prometheus' RFC 3339 time with nanoseconds -> unix seconds."""
    trimmed = re.sub(r"(\.\d{6})\d*", r"\1", text).replace("Z", "+00:00")
    return datetime.fromisoformat(trimmed).timestamp()


def _documented_labels(metric: str) -> set[str] | None:
    """Labels of `metric` in the docs' tables, or None if it is not documented."""
    for line in promql.reference_docs_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith(f"`{metric}`"):
            return set(re.findall(r"`(\w+)`", " ".join(cells[1:3])))
    return None


def _check_documented(query: promql.Query, expr: str) -> list[str]:
    problems = []
    for selector in promql.selectors(expr):
        name = promql.metric_name(selector)
        if promql.is_recording_rule(name) or name.startswith(promql.VLLM_PREFIX) or name == "up":
            continue
        labels = _documented_labels(name)
        if labels is None:
            problems.append(f"{query.where}: {name} is in no table of docs/*.md")
            continue
        labels |= {"job", "instance", "node", "rank", "site"}  # added by Prometheus, the scrape config, the hook
        unknown = promql.matcher_labels(selector) - labels
        if unknown:
            problems.append(f"{query.where}: labels {sorted(unknown)} are not labels of {name}")
    return problems


def _check_expression(stack: TwoNodeStack, query: promql.Query, expr: str) -> list[str]:
    """Problems with one expression (variables already substituted): empty when it is sound."""
    problems = []
    expr = promql.boolify(expr)
    try:
        if not stack.prometheus.query(expr):
            problems.append(f"{query.where}: no series for {expr!r}")
    except ValueError as exc:
        return [f"{query.where}: Prometheus rejected {expr!r}: {exc}"]
    seen_labels: set[str] = set()
    for selector in promql.selectors(expr):
        if AGENT_ONLY.search(selector):
            continue  # series that come through a Prometheus agent: this stack has none
        series = stack.prometheus.query(selector)
        if not series:
            problems.append(f"{query.where}: no series for the selector {selector}")
            continue
        labels = set().union(*(s["metric"] for s in series))
        seen_labels |= labels
        missing = promql.matcher_labels(selector) - labels
        if missing:
            problems.append(f"{query.where}: {selector} matches on labels {sorted(missing)} that its series lack")
    missing = promql.grouping_labels(expr) - seen_labels
    if seen_labels and missing:
        problems.append(f"{query.where}: by/on labels {sorted(missing)} are on none of the series of {expr!r}")
    return problems


def _variable_values(stack: TwoNodeStack, dashboard: dict) -> tuple[dict, list[dict]]:
    """({var: ".*"}, [{var: regex of a real value}, ...]) for the dashboard's query variables: one set per
    value of the first variable (the node), the later variables at their first value for that node."""
    variables = list(promql.variable_queries(dashboard).items())
    parsed = []
    for name, text in variables:
        match = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\)\s*", text)
        if not match:
            raise AssertionError(f"variable {name}: expected label_values(selector, label), got {text!r}")
        parsed.append((name, text, *match.groups()))
    all_values = {"datasource": "", **{name: ".*" for name, *_ in parsed}}
    (first, text, selector, label), rest = parsed[0], parsed[1:]
    firsts = stack.prometheus.label_values(label, promql.substitute(selector, {"datasource": ""}))
    if label == "node":  # the two nodes' events, not the collapse source that shares their Prometheus
        firsts = [value for value in firsts if value in {n.node for n in stack.nodes}]
    if not firsts:  # ValueError: wait_until asks again until the deadline
        raise ValueError(f"variable {first}: {text} has no values")
    real_sets = []
    for value in sorted(firsts):
        real = {"datasource": "", first: promql.promql_regex_literal(value)}
        for name, text, selector, label in rest:
            values = stack.prometheus.label_values(label, promql.substitute(selector, real))
            if not values:
                raise ValueError(f"variable {name}: {text} has no values with {real}")
            real[name] = promql.promql_regex_literal(sorted(values)[0])
        real_sets.append(real)
    return all_values, real_sets


def _pending(expr: str) -> list[str]:
    return [name for name in promql.PENDING_METRICS if name in expr]


# Rule expressions that are empty whenever all is well, by construction (`unless`, `absent()`): they are
# checked selector by selector only.
EMPTY_WHEN_HEALTHY = re.compile(r"\bunless\b|\babsent\(")


def _check(stack: TwoNodeStack, query: promql.Query, alternatives: list[str], rule: bool) -> list[str]:
    """Problems of the first alternative, unless some alternative (another node's values) has none."""
    first: list[str] | None = None
    for expr in alternatives:
        problems = _check_expression(stack, query, expr)
        if problems and rule and EMPTY_WHEN_HEALTHY.search(expr):
            problems = [p for p in problems if "no series for '" not in p]
        if not problems:
            return []
        first = problems if first is None else first
    return first or []


def _all_problems(stack: TwoNodeStack) -> tuple[list[str], list[str], int]:
    problems: list[str] = []
    not_here: list[str] = []
    jobs: list[tuple[promql.Query, list[str], bool]] = []
    for path in promql.DASHBOARDS:
        dashboard = promql.load_dashboard(path)
        all_values, real_sets = _variable_values(stack, dashboard)
        for query in promql.dashboard_queries(path):
            jobs.append((query, [promql.substitute(query.expr, all_values)], False))
            jobs.append((query, [promql.substitute(query.expr, real) for real in real_sets], False))
    for query in promql.rule_queries():
        jobs.append((query, [query.expr], True))
    for rule in promql.load_rules():
        if "record" in rule:
            jobs.append((promql.Query(f"{rule['_file']}: output of record {rule['record']}", rule["record"]),
                         [rule["record"]], False))
    for query, alternatives, is_rule in jobs:
        expr = alternatives[0]
        pending = _pending(expr)
        if pending:
            not_here.append(f"{query.where} (pending: {', '.join(pending)})")
            try:
                stack.prometheus.query(promql.boolify(expr))
            except ValueError as exc:
                problems.append(f"{query.where}: Prometheus rejected {expr!r}: {exc}")
        elif GPU_ONLY.search(expr):
            not_here.append(f"{query.where} (GPU series: no NVIDIA driver here)")
            problems += _check_documented(query, expr)
        elif reasons := [why for pattern, why in NOT_IN_THIS_STACK.items() if pattern.search(expr)]:
            not_here.append(f"{query.where} ({'; '.join(reasons)})")
            problems += _check_documented(query, expr)
        else:
            problems += _check(stack, query, alternatives, is_rule)
            if AGENT_ONLY.search(expr):
                not_here.append(f"{query.where} (its agent-only selector: no agent in this stack)")
    return problems, sorted(set(not_here)), len(jobs)


def test_every_dashboard_and_rule_expression_returns_series(stack, events):
    result = {}

    def settled():
        stack.check_running()
        result["value"] = _all_problems(stack)
        return not result["value"][0]

    try:
        wait_until("every expression returns series", settled, timeout=SERIES_TIMEOUT_S, interval=3)
    except TimeoutError as exc:
        problems = result["value"][0] if "value" in result else [str(exc)]
        pytest.fail(f"{len(problems)} problems:\n" + "\n".join(problems))
    _, not_here, checked = result["value"]
    print(f"{checked} expressions checked live")
    if not_here:
        print("not checked for data here:\n  " + "\n  ".join(not_here))


def test_alerts_carry_the_labels_they_template(stack, events):
    """Active alerts render their annotations: no `<no value>` from a label the series lack."""
    wait_until("some alert active", lambda: stack.prometheus.alerts(), timeout=30)
    for alert in stack.prometheus.alerts():
        for key, text in alert["annotations"].items():
            name = alert["labels"]["alertname"]
            assert "<no value>" not in text, f"{name}: {key} uses a label its series lack: {text}"
        assert alert["annotations"]["runbook_url"].startswith(RUNBOOK_BASE + "#"), alert["annotations"]


def test_the_live_check_catches_misspelt_names_and_keeps_false_conditions(stack):
    """The checker itself: a wrong name or label fails it, a condition that is false right now does not."""
    where = promql.Query("self-check", "")
    good = 'sum by (node) (memtel_node_mem_available_bytes{node=~".*"})'
    assert _check_expression(stack, where, good) == []
    assert _check_expression(stack, where, "memtel_node_mem_available_bytes > 1e30") == [], "boolify lost the series"
    assert not stack.prometheus.query("memtel_node_mem_available_bytes > 1e30"), "the plain condition should be empty"
    broken = {
        "metric": 'sum by (node) (memtel_node_mem_avail_bytes{node=~".*"})',
        "matcher label": 'sum by (node) (memtel_node_mem_available_bytes{nod=~".*"})',
        "grouping label": 'sum by (nodes) (memtel_node_mem_available_bytes{node=~".*"})',
        "label value": 'memtel_collector_success{collector="kmesg"} == 0',
        "vllm metric": 'sum by (node) (vllm:num_requests_runing{node=~".*"})',
    }
    for what, expr in broken.items():
        assert _check_expression(stack, where, expr), f"a misspelt {what} went unnoticed: {expr}"
