"""The dashboards and rules against a live Prometheus that scrapes the real daemon and a real hook.

What "every expression returns at least one series" means here, and how conditions are handled:
- Dashboard queries run twice: with every template variable set to `.*` (Grafana's "All") and with
  the first real value of each variable, as its own `label_values` query returns it.
- Rule expressions (alerts and recording rules) run with every comparison turned into a `bool`
  comparison (promql.boolify): `x > 0` becomes `x > bool 0`, which returns x's series with 0 or 1.
  An empty result then means a misspelt metric or label, not a condition that is false right now.
- Series that only exist after an event are made to exist by the event itself, through the real
  path: an Xid 79 and an Xid 13 line and an OOM-kill line are written into /dev/kmsg (memtel_kernel_
  xid_total{xid}, ..._last_seen_timestamp_seconds, oom_kills), and the hook process has a target
  that cannot be installed and an allocator read that fails now and then (install failures,
  hook errors by stage). Swap and PSI counters exist at 0 on this machine, so their
  rates are real series with value 0.
- Every vector selector is also queried on its own, every label it matches on must exist on its
  series, and every label of a by/on/without/ignoring clause must exist on the expression's series.
- Only GPU series (memtel_gpu_* except memtel_gpu_nvml_available) cannot exist without an NVIDIA
  driver. Where NVML is unavailable, those expressions are checked against docs/metrics.md
  instead (metric documented, every label used is one of its labels) and listed in the output.
Then an NV_ERR_NO_MEMORY line goes into /dev/kmsg and MemtelNvErrNoMemory must go pending or
firing through /api/v1/alerts within NV_ERR_ALERT_TIMEOUT_S.
"""

from __future__ import annotations

import re
import time
from datetime import datetime

import pytest

from tests.dashboards import promql
from tests.dashboards.live import LiveStack, wait_until, write_kmsg

pytestmark = [pytest.mark.prometheus, pytest.mark.kmsg, pytest.mark.timeout(300)]

NV_ERR_LINE = ("NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) "
               "returned from _memdescAllocInternal(pMemDesc) @ mem_desc.c:1359\n")
# Written before the checks so the Xid and OOM series exist; the text says who wrote them.
EVENT_LINES = (
    "NVRM: Xid (PCI:0000:01:00): 79, pid=1, name=memtel-live-test, GPU has fallen off the bus (memtel live test)\n",
    "NVRM: Xid (PCI:0000:01:00): 13, pid=1, name=memtel-live-test, Graphics Exception (memtel live test)\n",
    "Out of memory: Killed process 999999 (memtel-live-test) total-vm:0kB, anon-rss:0kB (memtel live test)\n",
)
NV_ERR_ALERT_TIMEOUT_S = 30
SERIES_TIMEOUT_S = 60
GPU_ONLY = re.compile(r"\bmemtel_gpu_(?!nvml_available)\w+")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    live = LiveStack(tmp_path_factory.mktemp("live-prometheus"))
    try:
        live.start()
        for line in EVENT_LINES:
            write_kmsg(line)
        wait_until("both memtel targets up in Prometheus",
                   lambda: live.targets_up() == {"memtel-daemon": "up", "memtel-hook-fleet": "up"},
                   timeout=SERIES_TIMEOUT_S)
        yield live
    except BaseException:
        print(live.logs())
        raise
    finally:
        live.stop()


@pytest.fixture(scope="module")
def nv_err_line(stack):
    """Write one NV_ERR_NO_MEMORY line; (unix time of the write, counter before, alert active before)."""
    # increase() needs two samples; until then the alert's condition cannot be judged.
    wait_until("two samples of memtel_kernel_nv_err_no_memory_total",
               lambda: stack.query("count_over_time(memtel_kernel_nv_err_no_memory_total[1m]) >= 2"),
               timeout=SERIES_TIMEOUT_S)
    counter_before = float(stack.query("memtel_kernel_nv_err_no_memory_total")[0]["value"][1])
    # The rule's own condition, now: true if a line less than 15 minutes old is already in the log.
    alert_rule = next(r for r in promql.load_rules() if r.get("alert") == "MemtelNvErrNoMemory")
    active_before = bool(stack.query(alert_rule["expr"]))
    written_at = time.time()
    write_kmsg(NV_ERR_LINE)
    return written_at, counter_before, active_before


def test_nv_err_no_memory_line_raises_the_alert(stack, nv_err_line):
    written_at, counter_before, active_before = nv_err_line
    started = time.monotonic()
    alerts = wait_until("MemtelNvErrNoMemory pending or firing after the NV_ERR_NO_MEMORY line",
                        lambda: [a for a in stack.alerts("MemtelNvErrNoMemory") if a["state"] in ("pending", "firing")],
                        timeout=NV_ERR_ALERT_TIMEOUT_S)
    print(f"MemtelNvErrNoMemory {alerts[0]['state']} {time.monotonic() - started:.1f} s after the line")
    alert = alerts[0]
    assert alert["labels"]["severity"] == "critical"
    assert alert["labels"]["node"] == stack.node
    assert alert["annotations"]["runbook_url"] == "docs/runbook.md#memtelnverrnomemory"
    wait_until("the daemon's count of NV_ERR_NO_MEMORY lines, scraped, rising by the line",
               lambda: float(stack.query("memtel_kernel_nv_err_no_memory_total")[0]["value"][1]) >= counter_before + 1,
               timeout=NV_ERR_ALERT_TIMEOUT_S)
    if not active_before:
        # The alert became active because of this line, not an older one.
        active_at = _parse_time(alert["activeAt"])
        assert active_at >= written_at - 1.0, f"active since {alert['activeAt']}, before the line was written"
    else:
        print("note: MemtelNvErrNoMemory was already active (an NV_ERR line less than 15 minutes old in this "
              "boot's kernel log); the counter rose with this line")


def _parse_time(text: str) -> float:
    """Prometheus' RFC 3339 time with nanoseconds -> unix seconds."""
    trimmed = re.sub(r"(\.\d{6})\d*", r"\1", text).replace("Z", "+00:00")
    return datetime.fromisoformat(trimmed).timestamp()


def test_xid_lines_raise_alerts_by_code(stack):
    def active(name, xid):
        return [a for a in stack.alerts(name)
                if a["labels"].get("xid") == xid and a["state"] in ("pending", "firing")]

    critical = wait_until("MemtelGpuXidCritical for Xid 79", lambda: active("MemtelGpuXidCritical", "79"), timeout=30)
    warning = wait_until("MemtelGpuXid for Xid 13", lambda: active("MemtelGpuXid", "13"), timeout=30)
    assert critical[0]["labels"]["severity"] == "critical"
    assert warning[0]["labels"]["severity"] == "warning"
    assert not active("MemtelGpuXid", "79") and not active("MemtelGpuXidCritical", "13"), "an Xid code alerted at both severities"


def _documented_labels(metric: str) -> set[str] | None:
    """Labels of `metric` in docs/metrics.md's tables, or None if it is not documented."""
    for line in (promql.ROOT / "docs" / "metrics.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith(f"`{metric}`"):
            return set(re.findall(r"`(\w+)`", cells[2]))
    return None


def _check_documented(query: promql.Query, expr: str) -> list[str]:
    problems = []
    for selector in promql.selectors(expr):
        labels = _documented_labels(promql.metric_name(selector))
        if labels is None:
            problems.append(f"{query.where}: {promql.metric_name(selector)} is not in docs/metrics.md")
            continue
        labels |= {"job", "instance", "node"}  # added by Prometheus and the scrape config
        unknown = (promql.matcher_labels(selector) | promql.grouping_labels(expr)) - labels
        if unknown:
            problems.append(f"{query.where}: labels {sorted(unknown)} are not labels of {promql.metric_name(selector)}")
    return problems


def _check_expression(stack: LiveStack, query: promql.Query, expr: str) -> list[str]:
    """Problems with one expression (variables already substituted): empty when it is sound."""
    problems = []
    expr = promql.boolify(expr)
    try:
        if not stack.query(expr):
            problems.append(f"{query.where}: no series for {expr!r}")
    except ValueError as exc:
        return [f"{query.where}: Prometheus rejected {expr!r}: {exc}"]
    seen_labels: set[str] = set()
    for selector in promql.selectors(expr):
        series = stack.query(selector)
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


def _variable_values(stack: LiveStack, dashboard: dict) -> tuple[dict, dict]:
    """({var: ".*"}, {var: regex of its first real value}) for the dashboard's query variables, in order."""
    all_values, real_values = {"datasource": ""}, {"datasource": ""}
    for name, text in promql.variable_queries(dashboard).items():
        match = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\)\s*", text)
        if not match:
            raise AssertionError(f"variable {name}: expected label_values(selector, label), got {text!r}")
        selector, label = match.groups()
        all_values[name] = ".*"
        values = stack.label_values(label, promql.substitute(selector, real_values))
        if not values:  # ValueError: wait_until asks again until the deadline
            raise ValueError(f"variable {name}: {text} has no values with {real_values}")
        real_values[name] = promql.promql_regex_literal(sorted(values)[0])
    return all_values, real_values


def _all_problems(stack: LiveStack) -> tuple[list[str], list[str], int]:
    problems, not_here, checked = [], [], 0
    nvml = stack.query("memtel_gpu_nvml_available == 1")
    jobs = []
    for path in promql.DASHBOARDS:
        dashboard = promql.load_dashboard(path)
        all_values, real_values = _variable_values(stack, dashboard)
        for query in promql.dashboard_queries(path):
            jobs += [(query, promql.substitute(query.expr, all_values)), (query, promql.substitute(query.expr, real_values))]
    for query in promql.rule_queries():
        jobs.append((query, query.expr))
    for rule in promql.load_rules():
        if "record" in rule:
            jobs.append((promql.Query(f"{rule['_file']}: output of record {rule['record']}", rule["record"]), rule["record"]))
    for query, expr in jobs:
        checked += 1
        if GPU_ONLY.search(expr) and not nvml:
            not_here.append(query.where)
            problems += _check_documented(query, expr)
        else:
            problems += _check_expression(stack, query, expr)
    return problems, sorted(set(not_here)), checked


def test_every_dashboard_and_rule_expression_returns_series(stack, nv_err_line):
    # nv_err_line: the NV_ERR last-seen series (annotations, "Last NV_ERR_NO_MEMORY") exists after it.
    result = {}

    def settled():
        stack.check_running()
        result.pop("value", None)
        result["value"] = _all_problems(stack)
        return not result["value"][0]

    try:
        wait_until("every expression returns series", settled, timeout=SERIES_TIMEOUT_S, interval=2)
    except TimeoutError as exc:
        problems = result["value"][0] if "value" in result else [str(exc)]
        pytest.fail(f"{len(problems)} problems:\n" + "\n".join(problems) + "\n" + stack.logs())
    _, not_here, checked = result["value"]
    print(f"{checked} expressions checked live")
    if not_here:
        print("checked against docs/metrics.md only (no NVIDIA driver here):\n  " + "\n  ".join(not_here))


def test_alerts_carry_the_labels_they_template(stack, nv_err_line):
    """Active alerts render their annotations: no `<no value>` from a label the series lack."""
    wait_until("some alert active", lambda: stack.alerts(), timeout=30)
    for alert in stack.alerts():
        for key, text in alert["annotations"].items():
            assert "<no value>" not in text, f"{alert['labels']['alertname']}: {key} uses a label its series lack: {text}"


def test_the_live_check_catches_misspelt_names_and_keeps_false_conditions(stack):
    """The checker itself: a wrong name or label fails it, a condition that is false right now does not."""
    where = promql.Query("self-check", "")
    good = 'sum by (node) (memtel_node_mem_available_bytes{node=~".*"})'
    assert _check_expression(stack, where, good) == []
    assert _check_expression(stack, where, "memtel_node_mem_available_bytes > 1e30") == [], "boolify lost the series"
    assert not stack.query("memtel_node_mem_available_bytes > 1e30"), "the plain condition should be empty"
    broken = {
        "metric": 'sum by (node) (memtel_node_mem_avail_bytes{node=~".*"})',
        "matcher label": 'sum by (node) (memtel_node_mem_available_bytes{nod=~".*"})',
        "grouping label": 'sum by (nodes) (memtel_node_mem_available_bytes{node=~".*"})',
        "label value": 'memtel_collector_success{collector="kmesg"} == 0',
    }
    for what, expr in broken.items():
        assert _check_expression(stack, where, expr), f"a misspelt {what} went unnoticed: {expr}"
