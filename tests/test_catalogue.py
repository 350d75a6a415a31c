"""One catalogue of names (telemetry/catalogue): what memtel produces, and what its docs, rules, dashboards and
golden files name, must agree with it.

`test_every_metric_name_agrees_with_the_catalogue` gathers every problem and fails once, listing them all:
- a family a collector produces (run live on fixtures: the daemon's collectors, its health, the flight
  recorder, the exporter's HTTP health, the hook's exporter over HTTP, the live forecast) that the catalogue
  lacks, or whose type, help or labels differ from its entry (with a catalogue line to paste);
- a metric name typed in code outside the catalogue (`...MetricFamily("memtel_...")`, `Counter("memtel_...")`)
  that the catalogue lacks;
- a memtel series named in docs/*.md, dashboards/README.md, a Prometheus rule or rule test
  (dashboards/prometheus/), a Grafana dashboard or a golden file (tests/fixtures/) that nothing produces
  (recording-rule outputs count as produced);
- a catalogue family that no doc lists.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from telemetry.catalogue import FAMILIES, Family, fields, sample_names
from tests.hook.test_golden_metrics import golden_exporter  # noqa: F401  (a fixture: the hook's real exporter)

ROOT = Path(__file__).parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
PROC = FIXTURES / "proc"

# A memtel series as written in text: `memtel_x`, `level:memtel_x:op`, `memtel:x` (a recording rule's output).
_TOKEN = re.compile(r"(?<![A-Za-z0-9_:./\-])((?:[a-z_]+:)?memtel[_:][A-Za-z0-9_:]*)(\*?)")
_LITERAL = re.compile(r"[\"'](memtel_[a-z0-9_]*[a-z0-9])[\"']")


# -- what is produced -------------------------------------------------------------------------------
def _daemon_families(tmp_path: Path) -> list[Metric]:
    from telemetry.daemon.collectors.buddyinfo import BuddyinfoCollector
    from telemetry.daemon.collectors.headroom import HeadroomCollector
    from telemetry.daemon.collectors.kmsg import kmsg_families
    from telemetry.daemon.collectors.meminfo import MeminfoCollector
    from telemetry.daemon.collectors.nvml import NvmlCollector, NvmlSnapshot
    from telemetry.daemon.collectors.pressure import PressureCollector
    from telemetry.daemon.collectors.processes import ProcessCollector
    from telemetry.daemon.collectors.vmstat import VmstatCollector
    from telemetry.daemon.kmsg.counts import CountsSnapshot
    from telemetry.daemon.registry import DaemonCollectors

    meminfo, vmstat, buddyinfo = (str(PROC / f"{n}.x86_64-debian12-24g") for n in ("meminfo", "vmstat", "buddyinfo"))
    snapshot = NvmlSnapshot.from_dict(json.loads((FIXTURES / "nvml" / "hgx__h200__580.159.04.json").read_text()))
    kinds = ("nv_err_no_memory", "nvrm_error", "oom_kill", "xid:79", "pattern:uvm")
    counts = CountsSnapshot(lines=dict.fromkeys(kinds, 2), events=dict.fromkeys(kinds, 1),
                            last_seen_wall=dict.fromkeys(kinds, 1.0e9))

    class Kmsg:
        def collect(self) -> list[Metric]:
            return kmsg_families(counts, ("uvm",))

    sources = {
        "meminfo": MeminfoCollector(meminfo), "vmstat": VmstatCollector(vmstat),
        "pressure": PressureCollector(str(PROC / "pressure-memory.x86_64-debian12-24g")),
        "buddyinfo": BuddyinfoCollector(buddyinfo),
        "headroom": HeadroomCollector(meminfo, buddyinfo, vmstat_path=vmstat),
        "nvml": NvmlCollector(types.SimpleNamespace(read=lambda: snapshot)),  # type: ignore[arg-type]
        "processes": ProcessCollector(), "kmsg": Kmsg(),
    }
    wrapper = DaemonCollectors(sources)
    return [*wrapper.collect(), *_flight_families(tmp_path), *_exporter_families()]


def _flight_families(tmp_path: Path) -> list[Metric]:
    from telemetry.flight.recorder import BootSummary, FlightRecorder

    recorder = FlightRecorder(tmp_path / "flight", "boot")
    # The state after a record was written, with a previous boot's ring read: every family is present.
    recorder.recording, recorder.last_record_time, recorder.last_write_seconds = True, 1.0e9, 0.001
    recorder.last_record_bytes = 900
    recorder.previous = BootSummary("previous", 10, 1.0e9, 1.0e9)
    return list(recorder.collect())


def _exporter_families() -> list[Metric]:
    from telemetry.exporter import MetricsServer
    from telemetry.exporter.metrics import ExporterCollector

    server = MetricsServer("127.0.0.1", 0, CollectorRegistry(auto_describe=False), name="catalogue test")
    try:
        return list(ExporterCollector(server).collect())
    finally:
        server.stop()


def _forecast_families() -> list[Metric]:
    from telemetry.allocator_counters import AllocatorCounters
    from telemetry.hook.forecast.collector import ForecastCollector
    from telemetry.hook.forecast.runner import ForecastResults
    from telemetry.hook.forecast.workload import make_workload
    from telemetry.hook.state import HookState
    from telemetry.model.indexer.forecast import Forecast
    from telemetry.model.indexer.shape import REFERENCE_SHAPE

    forecast = Forecast(tokens=1000, mode="stock", alloc_conf="", start=AllocatorCounters(0, 0, 0, 0),
                        reserved_growth_bytes=1, peak_reserved_bytes=2, peak_growth_bytes=2, num_device_alloc=1,
                        num_device_free=0)
    results = ForecastResults(workload=make_workload(REFERENCE_SHAPE, source="reference"), forecasts=(forecast,),
                              last_duration_s=0.1,
                              last_success_s=1.0e9, failures={"snapshot": 1}, cpu_seconds=0.5)
    state = HookState(node="n", targets={})
    return list(ForecastCollector(types.SimpleNamespace(results=results), state).collect())  # type: ignore[arg-type]


def _label_names(family: Metric) -> set[str]:
    if family.samples:
        return {key for sample in family.samples for key in sample.labels if key != "le"}
    return set(getattr(family, "_labelnames", ()))


def _paste_line(family: Metric, labels: set[str]) -> str:
    kind = {"gauge": "gauge", "counter": "counter", "histogram": "histogram"}.get(family.type, family.type)
    return f'{kind}("{family.name}", {family.documentation!r}, {tuple(sorted(labels))!r}, source="...")'


def _check_produced(families: list[Metric], where: str, problems: list[str]) -> set[str]:
    seen = set()
    for family in families:
        seen.add(family.name)
        entry = FAMILIES.get(family.name)
        labels = _label_names(family)
        if entry is None:
            problems.append(f"{where} produces {family.name}, which the catalogue lacks; add to "
                            f"telemetry/catalogue/metrics.py: {_paste_line(family, labels)}")
            continue
        if family.type != entry.type:
            problems.append(f"{family.name}: {where} produces a {family.type}, the catalogue says {entry.type}")
        if family.documentation != entry.help:
            problems.append(f"{family.name}: {where}'s help {family.documentation!r} != the catalogue's {entry.help!r}")
        if labels and labels != set(entry.labels):
            problems.append(f"{family.name}: {where}'s labels {sorted(labels)} != the catalogue's {list(entry.labels)}")
    return seen


def _constants_holding(family: Family) -> list[str]:
    """The names in telemetry/catalogue/metrics.py under which code reaches `family` (itself or a table of it)."""
    import telemetry.catalogue.metrics as metrics_module

    def holds(value: object) -> bool:
        if value is family:
            return True
        return isinstance(value, tuple) and any(holds(item) for item in value)

    return [name for name, value in vars(metrics_module).items() if not name.startswith("_") and holds(value)]


def _typed_in_code() -> dict[str, list[str]]:
    """memtel metric names typed as string literals outside the catalogue, in the files that build or read
    metrics (those that use prometheus_client): name -> files."""
    typed: dict[str, list[str]] = {}
    for package in ("telemetry", "harness"):
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            if "catalogue" in path.parts or "prometheus_client" not in text:
                continue
            for match in _LITERAL.finditer(text):
                typed.setdefault(match.group(1), []).append(str(path.relative_to(ROOT)))
    return typed


# -- what is named ----------------------------------------------------------------------------------
def _recording_rule_outputs() -> set[str]:
    outputs = set()
    for path in sorted((ROOT / "dashboards" / "prometheus").glob("*.yml")):
        for group in (yaml.safe_load(path.read_text()) or {}).get("groups", []):
            outputs.update(rule["record"] for rule in group.get("rules", []) if "record" in rule)
    return outputs


def _named_files() -> list[Path]:
    files = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "dashboards" / "README.md",
             *sorted((ROOT / "dashboards" / "prometheus").rglob("*.yml")),
             *sorted((ROOT / "dashboards" / "grafana").glob("*.json"))]
    files += [p for p in sorted(FIXTURES.rglob("*")) if p.is_file() and p.suffix in (".prom", ".md", ".yml", ".txt")]
    return files


def _names_in(path: Path) -> set[str]:
    text = path.read_text()
    if path.suffix == ".prom":  # a golden scrape: its sample names (label values name hooked test functions)
        return {m.group(1) for line in text.splitlines()
                if (m := re.match(r"(?:# (?:HELP|TYPE) )?([A-Za-z_:][A-Za-z0-9_:]*)", line)) and "memtel" in m.group(1)}
    names = set()
    for match in _TOKEN.finditer(text):
        token, star = match.group(1).rstrip(":"), match.group(2)
        if token == "memtel":  # "memtel: ..." (a log line), not a name
            continue
        names.add(token + star if star or token.endswith("_") else token)
    return names


def _known_names() -> set[str]:
    """Series and family names of the catalogue, recording rules' outputs and the other memtel identifiers."""
    return {*sample_names(), *FAMILIES, *_recording_rule_outputs(), *fields.OTHER_NAMES}


def _known(name: str, produced: set[str]) -> bool:
    if name.endswith("*") or name.endswith("_"):  # a prefix: memtel_hook_*, memtel_forecast_
        prefix = name.rstrip("*")
        return any(p.startswith(prefix) for p in produced)
    return name in produced


def test_every_metric_name_agrees_with_the_catalogue(tmp_path, golden_exporter):  # noqa: F811
    problems: list[str] = []
    produced_names = set()
    produced_names |= _check_produced(_daemon_families(tmp_path), "the node daemon", problems)
    hook_text = httpx.get(golden_exporter, timeout=5).text
    produced_names |= _check_produced(list(text_string_to_metric_families(hook_text)), "the hook's exporter",
                                      problems)
    produced_names |= _check_produced(_forecast_families(), "the live forecast", problems)

    typed = _typed_in_code()
    series = sample_names()
    for name, files in sorted(typed.items()):
        if name not in FAMILIES and name not in series:
            problems.append(f"{name} is typed in {', '.join(sorted(set(files)))} and is in no catalogue entry")
    code = "\n".join(p.read_text() for pkg in ("telemetry", "harness") for p in (ROOT / pkg).rglob("*.py")
                     if "catalogue" not in p.parts)
    identifiers = set(re.findall(r"\b[A-Z][A-Z0-9_]*\b", code))
    for family in FAMILIES.values():
        if family.name in produced_names or family.name in typed:
            continue
        if not any(constant in identifiers for constant in _constants_holding(family)):
            problems.append(f"the catalogue lists {family.name}, which nothing produces")

    known = _known_names()
    for path in _named_files():
        for name in sorted(_names_in(path)):
            if not _known(name, known):
                problems.append(f"{path.relative_to(ROOT)} names {name}, which nothing produces")

    documented = set().union(*(_names_in(p) for p in [*(ROOT / "docs").glob("*.md"), ROOT / "dashboards/README.md"]))
    for family in FAMILIES.values():
        if family.series not in documented:
            problems.append(f"{family.series} ({family.source}) is produced but no doc lists it (docs/*.md)")

    assert not problems, (f"{len(problems)} name problem(s):\n" + "\n".join(problems) + "\n(the catalogue: "
                          "telemetry/catalogue/metrics.py; \"nothing produces\": no catalogue series, no recording "
                          "rule; a memtel identifier that is no metric: telemetry/catalogue/fields.py OTHER_NAMES)")


def test_a_misspelt_name_in_a_doc_is_caught(tmp_path):
    """The check itself: an unknown name, a prefix that matches nothing, and the forms that are allowed."""
    known = _known_names()
    doc = tmp_path / "x.md"
    doc.write_text("`memtel_node_mem_available_byte` and `memtel_nope_*`; `memtel_hook_*`, "
                   "rate(memtel_hook_calls_total[5m]), instance:memtel_node_mem_available:ratio, test_memtel_port\n")
    unknown = sorted(n for n in _names_in(doc) if not _known(n, known))
    assert unknown == ["memtel_node_mem_available_byte", "memtel_nope_*"]


# -- record fields ----------------------------------------------------------------------------------
def test_the_call_log_keys_are_the_catalogues_and_documented():
    from telemetry.hook.call_log import KEYS

    assert KEYS == fields.CALL_LOG_KEYS
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Hook per-call log (JSONL)"):]
    section = section[:section.index("\n## ")]
    missing = [key for key in fields.CALL_LOG_KEYS if f"`{key}`" not in section]
    assert missing == [], f"docs/architecture.md's per-call log section lacks {missing}"


def test_the_hooks_log_writes_the_catalogues_keys_in_order(golden_exporter, tmp_path):  # noqa: F811
    logs = list((tmp_path / "logs").glob("memtel-calls-*.jsonl"))
    lines = [json.loads(line) for path in logs for line in path.read_text().splitlines()]
    assert lines
    for record in lines:
        keys = list(record)
        assert keys == [k for k in fields.CALL_LOG_KEYS if k in record], keys
        assert set(fields.ALLOCATOR_COUNTERS) <= set(keys) or not set(fields.ALLOCATOR_COUNTERS) & set(keys)


def test_the_harness_snapshots_read_the_catalogues_series():
    from harness.ab import samplers
    from harness.ab.records import NodeSnapshot, RankSnapshot

    def names(cls: type) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)} - {"ts", "error", "xid_by_code"}

    assert names(NodeSnapshot) == set(fields.NODE_SNAPSHOT_SERIES)
    assert names(RankSnapshot) == set(fields.RANK_SNAPSHOT_SERIES)
    assert samplers.NODE_SERIES is fields.NODE_SNAPSHOT_SERIES
    produced = set(sample_names())
    assert set(fields.NODE_SNAPSHOT_SERIES.values()) | set(fields.RANK_SNAPSHOT_SERIES.values()) <= produced


_OTHER_SPELLINGS = re.compile(r"""(?<![A-Za-z0-9_])(?:device_allocs|device_alloc_total|device_free_total|"""
                              r"""device_frees|alloc_retries_total|ooms_total)(?![A-Za-z0-9_])""")


def test_allocator_counters_are_spelt_one_way():
    """`num_device_alloc` & co. everywhere: records, tables, reports, docs. The only other spellings allowed are the
    results.jsonl reader's map from the old field names (harness/ab/records.py LEGACY) and Prometheus' names."""
    found = []
    for package in ("telemetry", "harness", "benchmarks", "docs"):
        for path in sorted((ROOT / package).rglob("*")):
            if path.suffix not in (".py", ".md") or "catalogue" in path.parts:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if path.relative_to(ROOT).as_posix() == "harness/ab/records.py" or "`device_alloc_total`, ...)" in line:
                    continue  # the results.jsonl reader's old names, and the docs' sentence about them
                for match in _OTHER_SPELLINGS.finditer(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)}")
    assert found == [], f"{len(found)} other spelling(s) of the allocator counters:\n" + "\n".join(found)


@pytest.mark.parametrize("name", ["memtel_hook_calls", "memtel_hook_calls_total"])
def test_family_lookup_by_family_or_series_name(name):
    from telemetry.catalogue import family

    assert family(name).series == "memtel_hook_calls_total"
    with pytest.raises(KeyError):
        family("memtel_hook_call")
